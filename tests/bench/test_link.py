"""The link peak transfers are measured against."""

from backfill.bench.link import LinkPeak, parse_nvidia_smi, pcie_peak_gb_per_s, read_link_peak


def test_pcie_peaks_per_direction():
    assert abs(pcie_peak_gb_per_s(5, 16) - 63.0) < 0.01           # H100 / H200 host link
    assert abs(pcie_peak_gb_per_s(4, 16) - 31.5) < 0.01
    assert pcie_peak_gb_per_s(None, 16) is None and pcie_peak_gb_per_s(9, 16) is None
    assert pcie_peak_gb_per_s(4, 0) is None


def test_nvidia_smi_csv_is_parsed_per_gpu():
    text = "5, 16\n4, 8\n"
    assert parse_nvidia_smi(text) == (5, 16) and parse_nvidia_smi(text, 1) == (4, 8)
    assert parse_nvidia_smi(text, 2) is None
    assert parse_nvidia_smi("[N/A], [N/A]\n") is None and parse_nvidia_smi("") is None


def test_reading_the_peak_never_fails():
    peak = read_link_peak()
    assert isinstance(peak, LinkPeak) and peak.source in ("pynvml", "nvidia-smi", "none")
    assert set(peak.as_dict()) >= {"pcie_gen", "pcie_width", "pcie_gb_per_s", "source"}
