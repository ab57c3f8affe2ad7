"""deploy/: the alert rules pass promtool (syntax and their unit tests), the dashboards are
what Grafana provisions (variables, units, $__rate_interval), vLLM's dashboard keeps its license,
and the compose file's defaults are the safe ones."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian: apt-get install prometheus)")
def test_alert_rules_pass_promtool_and_their_unit_tests():
    checked = subprocess.run([PROMTOOL, "check", "rules", "alerts.yml"], cwd=DEPLOY, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 9 rules found" in checked.stdout
    tested = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=DEPLOY, capture_output=True,
                            text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_is_unit_tested():
    rules = (DEPLOY / "alerts.yml").read_text()
    tests = (DEPLOY / "alerts_test.yml").read_text()
    alerts = re.findall(r"- alert: (\w+)", rules)
    assert {"BackfillTTFTSLOBurnFast", "BackfillOnlineRefusals", "BackfillOfflineStarved",
            "BackfillKVCacheExhausted"} <= set(alerts)
    untested = [a for a in alerts if f"alertname: {a}" not in tests and a != "BackfillTTFTSLOBurnSlow"]
    assert not untested, untested


def test_backfills_dashboard_has_variables_units_and_rate_interval():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "backfill.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert {"instance", "model_name"} <= set(variables)
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        unit = panel["fieldConfig"]["defaults"]["unit"]
        assert unit != "short", panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert not re.search(r"\[\d+[smh]\]", expr), (panel["title"], expr)   # $__rate_interval, not [1m]
            if "rate(" in expr:
                assert "[$__rate_interval]" in expr, expr
            assert 'instance=~"$instance"' in expr, expr
            if expr.count("backfill_") and "backfill_http_" not in expr:
                assert 'model_name=~"$model_name"' in expr, expr
        if re.search(r"seconds(_bucket)?\b", " ".join(t["expr"] for t in panel["targets"])) \
                and "histogram_quantile" in panel["targets"][0]["expr"]:
            assert unit == "s", panel["title"]


def test_vllms_dashboard_is_kept_verbatim_with_its_license():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "vllm.json").read_text())
    assert dashboard["description"] == "Monitoring vLLM Inference Server"
    assert "Apache License" in (DEPLOY / "grafana" / "dashboards" / "vllm.LICENSE").read_text()
    assert "vllm.json" in (DEPLOY / "grafana" / "dashboards" / "NOTICE").read_text()


def test_compose_binds_localhost_keeps_prometheus_data_and_reads_the_grafana_password():
    compose = (DEPLOY / "compose.yaml").read_text()
    ports = re.findall(r'"(\$\{[A-Z_]+:-127\.0\.0\.1\}:\d+:\d+)"', compose)
    assert len(ports) == 3 and len(re.findall(r"ports:", compose)) == 3, ports
    assert "prometheus-data:/prometheus" in compose
    assert "GF_SECURITY_ADMIN_PASSWORD__FILE" in compose or "env_file" in compose
    assert "alerts.yml" in compose and "rule_files" in (DEPLOY / "prometheus.yml").read_text()
