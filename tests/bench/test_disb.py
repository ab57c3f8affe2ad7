import json

import numpy as np
import pytest

from backfill.bench.disb import DisbWorkload, disb_preset, load_disb, save_disb
from backfill.bench.prompts import PromptSource
from backfill.errors import WorkloadError
from backfill.types import RequestClass

FILE = {"name": "mine", "duration_s": 10,
        "clients": [{"name": "rt", "model": "m", "task": "chat", "priority": "real-time", "arrival": "uniform",
                     "rate_per_s": 2.0, "prompt_len": "fixed:16", "output_len": "fixed:4"},
                    {"name": "rtp", "priority": "real-time", "arrival": "poisson", "rate_per_s": 5,
                     "prompt_len": "uniform:8:12", "output_len": "fixed:2"},
                    {"name": "be", "priority": "best-effort", "arrival": "closed-loop", "concurrency": 3,
                     "pool_size": 7, "prompt_len": "fixed:32", "output_len": "fixed:8"}]}


def test_load_save_round_trip(tmp_path):
    p = tmp_path / "w.json"
    p.write_text(json.dumps(FILE))
    w = load_disb(p)
    assert [c.name for c in w.clients] == ["rt", "rtp", "be"]
    assert w.clients[2].concurrency == 3 and w.clients[0].rate_per_s == 2.0
    save_disb(w, tmp_path / "again.json")
    assert load_disb(tmp_path / "again.json") == w


def test_to_workload(tmp_path, bpe):
    p = tmp_path / "w.json"
    p.write_text(json.dumps(FILE))
    wl = load_disb(p).to_workload(PromptSource(bpe, seed=0), seed=3)
    uniform = [r for r in wl.requests if r.client == "rt"]
    assert len(uniform) == 20 and np.allclose(np.diff([r.arrival_s for r in uniform]), 0.5)
    assert all(r.request_class is RequestClass.ONLINE for r in wl.requests)
    assert 20 <= sum(r.client == "rtp" for r in wl.requests) <= 80
    (be,) = wl.offline_backlogs
    assert be.concurrency == 3 and len(be.requests) == 7 and be.client == "be"
    assert wl.duration_s == 10
    assert wl.all_requests() == load_disb(p).to_workload(PromptSource(bpe, seed=0), seed=3).all_requests()


@pytest.mark.parametrize("letter,n_rt,n_be,arrival", [("A", 1, 1, "uniform"), ("B", 1, 1, "uniform"),
                                                       ("C", 1, 5, "uniform"), ("D", 5, 5, "uniform"),
                                                       ("E", 5, 5, "poisson")])
def test_presets_follow_reef_table_2(letter, n_rt, n_be, arrival):
    w = disb_preset(letter, max_rate_per_s=10.0)
    rt = [c for c in w.clients if c.priority == "real-time"]
    be = [c for c in w.clients if c.priority == "best-effort"]
    assert (len(rt), len(be)) == (n_rt, n_be)
    assert all(c.arrival == arrival for c in rt) and all(c.arrival == "closed-loop" for c in be)
    share = {"A": 0.5, "B": 1.0, "C": 0.5, "D": 0.1, "E": 0.1}[letter]
    assert all(c.rate_per_s == pytest.approx(share * 10.0) for c in rt)


def _with(**changes):
    obj = json.loads(json.dumps(FILE))
    for key, value in changes.items():
        idx, field = key.split("__")
        if value is None:
            del obj["clients"][int(idx[1:])][field]
        else:
            obj["clients"][int(idx[1:])][field] = value
    return obj


@pytest.mark.parametrize("obj,match", [
    (_with(c0__priority="urgent"), r"clients\[0\].*priority"),
    (_with(c0__arrival="bursty"), r"clients\[0\].*arrival"),
    (_with(c0__rate_per_s=-1), r"clients\[0\].*rate_per_s"),
    (_with(c0__rate_per_s=None), r"clients\[0\].*rate_per_s"),
    (_with(c2__concurrency=0), r"clients\[2\].*concurrency"),
    (_with(c1__arrival="closed-loop", c1__concurrency=2, c1__rate_per_s=None), r"real-time clients are open loop"),
    (_with(c0__prompt_len="fixed:0"), r"clients\[0\].*>= 1"),
    (_with(c0__output_len=None), r"missing field 'output_len'"),
    (_with(c0__colour="red"), r"unknown field"),
    (_with(c2__name="rt"), r"unique"),
    ({**FILE, "duration_s": 0}, r"duration_s"),
    ({**FILE, "clients": []}, r"at least one client"),
    ({**FILE, "clients": [FILE["clients"][2]]}, r"open-loop client"),
    ([1, 2], r"JSON object"),
])
def test_invalid_files(tmp_path, obj, match):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(obj))
    with pytest.raises(WorkloadError, match=match):
        load_disb(p)


def test_file_errors(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text('{"name": "x",\n "clients": [}')
    with pytest.raises(WorkloadError, match=r"broken.json:2:"):
        load_disb(p)
    with pytest.raises(WorkloadError, match="no such"):
        load_disb(tmp_path / "missing.json")
    with pytest.raises(WorkloadError, match="unknown DISB"):
        disb_preset("F", 1.0)
    assert isinstance(disb_preset("a", 1.0), DisbWorkload)
