"""The peak of the link between a GPU and its host (or its NVLink peers), read from the device, so
measured transfer rates can be set against it (AQUA §7: paging runs at the interconnect's rate).

Sources, first that answers: NVML through pynvml (PCIe generation and width, NVLink links up),
then `nvidia-smi --query-gpu=pcie.link.gen.max,pcie.link.width.max`. Per-direction peaks are
the PCIe payload rates after line coding (gen 3 onward 128b/130b); NVLink counts 25 GB/s per
direction per link (NVLink 3 and 4).
"""

from __future__ import annotations

import subprocess
from dataclasses import asdict, dataclass

# GB/s per lane per direction, after encoding (gen 1-2: 8b/10b; gen 3-5: 128b/130b; gen 6: FLIT).
PCIE_LANE_GB_PER_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
NVLINK_LINK_GB_PER_S = 25.0


@dataclass(frozen=True)
class LinkPeak:
    pcie_gen: int | None
    pcie_width: int | None
    pcie_gb_per_s: float | None       # per direction
    nvlink_links: int = 0
    nvlink_gb_per_s: float | None = None
    source: str = "none"              # pynvml | nvidia-smi | none

    def as_dict(self) -> dict:
        return asdict(self)


def pcie_peak_gb_per_s(gen: int | None, width: int | None) -> float | None:
    if gen not in PCIE_LANE_GB_PER_S or not width or width < 1:
        return None
    return PCIE_LANE_GB_PER_S[gen] * width


def parse_nvidia_smi(text: str, index: int = 0) -> tuple[int, int] | None:
    """(gen, width) from the CSV of `nvidia-smi --query-gpu=pcie.link.gen.max,pcie.link.width.max
    --format=csv,noheader,nounits`, one line per GPU; None when the line is missing or not numbers."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if index >= len(lines):
        return None
    parts = [p.strip() for p in lines[index].split(",")]
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _from_pynvml(index: int) -> LinkPeak | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: another source may answer
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        gen = int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
        width = int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
        links = 0
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                links += int(pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED)
            except Exception:  # noqa: BLE001 - no NVLink, or no such link
                break
        return LinkPeak(gen, width, pcie_peak_gb_per_s(gen, width), links,
                        links * NVLINK_LINK_GB_PER_S if links else None, "pynvml")
    except Exception:  # noqa: BLE001
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _from_nvidia_smi(index: int) -> LinkPeak | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=pcie.link.gen.max,pcie.link.width.max",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parsed = parse_nvidia_smi(out.stdout, index) if out.returncode == 0 else None
    if parsed is None:
        return None
    gen, width = parsed
    return LinkPeak(gen, width, pcie_peak_gb_per_s(gen, width), source="nvidia-smi")


def read_link_peak(index: int = 0) -> LinkPeak:
    """The device's link peak from the first source that answers; LinkPeak(None, ...) if none does."""
    return _from_pynvml(index) or _from_nvidia_smi(index) or LinkPeak(None, None, None)
