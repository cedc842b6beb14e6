"""`slipstream bench serve` against a fake streaming server (tests/fake_openai_server.py)
run as a subprocess on a free loopback port."""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import pytest

from slipstream.bench.serve import arrival_offsets, main

pytestmark = pytest.mark.subprocess  # fake OpenAI servers (tests/fake_openai_server.py)

HERE = os.path.dirname(os.path.abspath(__file__))
FIRST, TOKEN = 0.15, 0.02  # the default fake server's delays (s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as f:
        return json.load(f) if "health" not in url else f.read()


class FakeServer:
    def __init__(self, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "fake_openai_server.py"),
             "--port", str(self.port), *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 15
        while True:
            try:
                _get(self.url + "/health")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("fake server did not start: "
                                       + self.proc.stderr.read().decode()[-2000:])
                time.sleep(0.05)

    def stats(self) -> dict:
        return _get(self.url + "/stats")

    def reset(self) -> None:
        urllib.request.urlopen(urllib.request.Request(self.url + "/stats/reset", data=b"",
                                                      method="POST"), timeout=5).read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="module")
def servers():
    made: dict[tuple, FakeServer] = {}

    def get(*flags: str) -> FakeServer:
        flags = flags or ("--first-delay", str(FIRST), "--token-delay", str(TOKEN))
        if flags not in made:
            made[flags] = FakeServer(*flags)
        made[flags].reset()
        return made[flags]

    yield get
    for s in made.values():
        s.stop()


def _jsonl(tmp_path, rows, name="d.jsonl") -> str:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def _run(server, tmp_path, *flags, result="r.json") -> tuple[int, dict | None]:
    out = tmp_path / result
    rc = main(["--base-url", server.url, "--disable-tqdm", "--result-file", str(out), *flags])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_metrics_on_known_delays_and_block(servers, tmp_path, capsys):
    s = servers()
    lens = [10, 20, 5, 30]
    data = _jsonl(tmp_path, [{"prompt": "a b c", "max_tokens": n} for n in lens])
    rc, r = _run(s, tmp_path, "--dataset", data, "--save-result")
    assert rc == 0
    assert r["completed"] == 4 and r["failed"] == 0
    assert r["output_lens"] == lens and r["total_output_tokens"] == sum(lens)
    assert r["input_lens"] == [3] * 4 and r["total_input_tokens"] == 12  # from usage
    # Sleeps never end early; a loaded machine makes them later, so the upper bounds
    # are loose while the identities between the numbers are exact.
    for ttft, itl, e2e, n in zip(r["ttfts"], r["itls"], r["e2els"], lens):
        assert FIRST - 0.005 < ttft < FIRST + 0.1
        assert len(itl) == n - 1  # one gap per content chunk
        assert sum(itl) == pytest.approx(e2e - ttft, abs=1e-9)
        assert TOKEN - 0.003 < statistics.median(itl) < TOKEN + 0.02
    tpots = [(e2e - t) / (n - 1) for t, e2e, n in zip(r["ttfts"], r["e2els"], lens)]
    assert r["median_tpot_ms"] == pytest.approx(statistics.median(tpots) * 1000)
    assert r["mean_ttft_ms"] == pytest.approx(statistics.fmean(r["ttfts"]) * 1000)
    assert r["mean_itl_ms"] == pytest.approx(statistics.fmean(sum(r["itls"], [])) * 1000)
    assert r["median_e2el_ms"] == pytest.approx(statistics.median(r["e2els"]) * 1000)
    assert TOKEN * 1000 - 3 < r["median_tpot_ms"] < TOKEN * 1000 + 20
    assert r["duration"] >= FIRST + TOKEN * 29
    assert r["output_throughput"] == pytest.approx(sum(lens) / r["duration"])
    assert r["request_throughput"] == pytest.approx(4 / r["duration"])
    assert 0 < r["max_output_tokens_per_s"] <= sum(lens)
    assert r["slipstream_version"] and r["date"].startswith("20") and "--save-result" in r["argv"]
    assert r["args"]["dataset"] == data and r["model"] == "fake-model"
    rc, r = _run(s, tmp_path, "--dataset", data, "--api-key", "sekrit", result="k.json")
    assert rc == 0 and "sekrit" not in json.dumps(r)
    assert s.stats()["bodies"][-1]["model"] == "fake-model"

    out = capsys.readouterr().out
    block = out[out.index("============ Serving"):].splitlines()
    labels = [line.split(":")[0] + ":" if ":" in line else line for line in block]
    expected = ["============ Serving Benchmark Result ============",
                "Successful requests:", "Failed requests:", "Benchmark duration (s):",
                "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
                "Output token throughput (tok/s):", "Peak output token throughput (tok/s):",
                "Peak concurrent requests:", "Total Token throughput (tok/s):",
                "---------------Time to First Token----------------",
                "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                "-----Time per Output Token (excl. 1st token)------",
                "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
                "---------------Inter-token Latency----------------",
                "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):",
                "----------------End-to-end Latency----------------",
                "Mean E2EL (ms):", "Median E2EL (ms):", "P99 E2EL (ms):",
                "=================================================="]
    assert labels[:len(expected)] == expected
    assert all(len(line) == 50 for line in expected if line[0] in "=-")
    assert block[1].split() == ["Successful", "requests:", "4"]
    assert block[1].index("4") == 41  # label padded to 40, one space


def test_failed_requests_counted_with_errors(servers, tmp_path, capsys):
    s = servers()
    rows = [{"prompt": "ok one", "max_tokens": 4}, {"prompt": "FAIL500 x", "max_tokens": 4},
            {"prompt": "FAILSTREAM x", "max_tokens": 6}, {"prompt": "ok two", "max_tokens": 3}]
    rc, r = _run(s, tmp_path, "--dataset", _jsonl(tmp_path, rows))
    assert rc == 0
    assert r["completed"] == 2 and r["failed"] == 2
    assert r["output_lens"] == [4, 0, 0, 3] and r["total_output_tokens"] == 7
    assert r["errors"][0] == "" and r["errors"][3] == ""
    assert r["errors"][1].startswith("HTTP 500") and "injected failure" in r["errors"][1]
    assert "injected stream error" in r["errors"][2]
    assert r["ttfts"][1] is None and r["e2els"][2] is None
    assert "Failed requests:                         2" in capsys.readouterr().out


def test_all_failed_and_bad_arguments(servers, tmp_path):
    s = servers()
    data = _jsonl(tmp_path, [{"prompt": "FAIL500"}])
    assert _run(s, tmp_path, "--dataset", data)[0] == 1  # the initial test request fails
    rc, r = _run(s, tmp_path, "--dataset", data, "--skip-initial-test")
    assert rc == 1 and r["failed"] == 1 and r["completed"] == 0
    assert main(["--base-url", s.url, "--endpoint", "/v1/chat/completions",
                 "--dataset", "random", "--num-prompts", "2"]) == 2  # token ids to chat
    assert main(["--base-url", s.url, "--goodput", "latency:3", "--num-prompts", "1"]) == 2


def test_multi_token_chunks_count_one_gap(servers, tmp_path):
    s = servers("--first-delay", "0.05", "--token-delay", "0.01", "--tokens-per-chunk", "4")
    data = _jsonl(tmp_path, [{"prompt": [1, 2, 3, 4, 5], "output_len": 16}] * 2)
    rc, r = _run(s, tmp_path, "--dataset", data)
    assert rc == 0 and r["output_lens"] == [16, 16] and r["input_lens"] == [5, 5]
    for itl in r["itls"]:
        assert len(itl) == 3 and all(0.035 < g < 0.07 for g in itl)
    # TPOT divides by tokens, not chunks: 3 gaps of ~40 ms over 15 tokens.
    for t, e2e, itl in zip(r["ttfts"], r["e2els"], r["itls"]):
        assert (e2e - t) / 15 == pytest.approx(sum(itl) / 15)
    assert 120 / 15 - 1 < r["median_tpot_ms"] < 210 / 15


def test_usage_fallback_counts_chunks(servers, tmp_path):
    s = servers("--first-delay", "0", "--token-delay", "0.001", "--tokens-per-chunk", "2")
    data = _jsonl(tmp_path, [{"prompt": "x", "max_tokens": 7}])
    rc, r = _run(s, tmp_path, "--dataset", data, "--extra-body",
                 '{"stream_options": {"include_usage": false}}')
    assert rc == 0 and r["output_lens"] == [4]  # 2+2+2+1 tokens in 4 chunks, no usage


def test_max_concurrency_is_respected(servers, tmp_path):
    s = servers("--first-delay", "0.05", "--token-delay", "0.01")
    data = _jsonl(tmp_path, [{"prompt": "p", "max_tokens": 10}] * 12)
    rc, r = _run(s, tmp_path, "--dataset", data, "--max-concurrency", "3",
                 "--skip-initial-test")
    assert rc == 0 and r["completed"] == 12
    st = s.stats()
    assert st["requests"] == 12 and st["peak"] == 3
    assert r["max_concurrent_requests"] == 3
    s.reset()
    rc, r = _run(s, tmp_path, "--dataset", data, "--skip-initial-test")
    assert rc == 0 and s.stats()["peak"] == 12  # no limit: all at once, one session
    assert r["max_concurrent_requests"] == 12


def test_num_workers_split_load_and_keep_order(servers, tmp_path):
    s = servers("--first-delay", "0.05", "--token-delay", "0.01")
    lens = [3, 4, 5, 6, 7, 8, 9, 10, 11]
    data = _jsonl(tmp_path, [{"prompt": "p", "max_tokens": n} for n in lens])
    rc, r = _run(s, tmp_path, "--dataset", data, "--num-workers", "2", "--max-concurrency",
                 "4", "--skip-initial-test")
    assert rc == 0 and r["completed"] == 9 and r["output_lens"] == lens
    assert s.stats()["peak"] == 4  # 2 + 2
    assert sorted(b["seed"] for b in s.stats()["bodies"]) == list(range(9))
    assert 0 <= min(r["start_times"]) and max(r["start_times"]) < r["duration"]


def test_peak_output_throughput_window():
    from slipstream.bench.serve_report import RequestResult, peak_tokens_per_s
    a = RequestResult(success=True, output_tokens=4, chunk_times=[0.0, 0.5, 0.9, 1.2])
    b = RequestResult(success=True, output_tokens=6, chunk_times=[1.0, 1.1, 3.0])  # 2 each
    # window (0.2, 1.2]: a@0.5, a@0.9, b@1.0, b@1.1, a@1.2 -> 1 + 1 + 2 + 2 + 1
    assert peak_tokens_per_s([a, b]) == 7.0
    assert peak_tokens_per_s([]) == 0.0


def test_request_rate_arrivals(servers, tmp_path):
    s = servers("--first-delay", "0.01", "--token-delay", "0.005")
    n, rate, seed = 12, 15.0, 3
    data = _jsonl(tmp_path, [{"prompt": "p", "max_tokens": 3}] * n)
    rc, r = _run(s, tmp_path, "--dataset", data, "--request-rate", str(rate),
                 "--seed", str(seed), "--skip-initial-test")
    assert rc == 0 and r["request_rate"] == rate
    want = arrival_offsets(n, rate, 1.0, seed)
    got = sorted(s.stats()["arrivals"])
    got = [t - got[0] for t in got]
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.06
    assert max(abs(a - b) for a, b in zip(sorted(r["start_times"]), want)) < 0.03
    assert want[-1] <= r["duration"] < want[-1] + 1.0


def test_arrival_offsets_distribution():
    assert arrival_offsets(5, float("inf"), 1.0, 0) == [0.0] * 5
    n, rate = 4000, 50.0
    for b in (1.0, 4.0):
        t = arrival_offsets(n, rate, b, 1)
        gaps = [y - x for x, y in zip(t, t[1:])]
        mean = statistics.fmean(gaps)
        assert abs(mean - 1 / rate) < 0.1 / rate
        cv = statistics.pstdev(gaps) / mean  # gamma: 1/sqrt(shape)
        assert abs(cv - b ** -0.5) < 0.1
    assert arrival_offsets(10, 5.0, 1.0, 7) == arrival_offsets(10, 5.0, 1.0, 7)


def test_payloads_seeds_and_small_256(servers, tmp_path):
    s = servers("--first-delay", "0", "--token-delay", "0")
    rc, r = _run(s, tmp_path, "--dataset", "small-256", "--num-prompts", "3", "--seed", "5",
                 "--skip-initial-test")
    assert rc == 0
    from slipstream.bench.workloads import small_256
    w = small_256()
    bodies = sorted(s.stats()["bodies"], key=lambda b: b["seed"])
    assert [b["seed"] for b in bodies] == [5, 6, 7]
    for b, p, sp in zip(bodies, w.prompts, w.params):
        assert b["prompt"] == p and b["max_tokens"] == sp.max_tokens
        assert b["temperature"] == 0.6 and b["ignore_eos"] is True and b["stream"] is True
        assert b["stream_options"] == {"include_usage": True} and b["model"] == "fake-model"
    assert r["output_lens"] == [sp.max_tokens for sp in w.params[:3]]
    assert r["input_lens"] == [len(p) for p in w.prompts[:3]]

    s.reset()
    rc, r = _run(s, tmp_path, "--num-prompts", "4", "--random-input-len", "20",
                 "--random-output-len", "6", "--random-range-ratio", "0.5", "--temperature",
                 "0.3", "--skip-initial-test")
    assert rc == 0
    for b in s.stats()["bodies"]:
        assert 10 <= len(b["prompt"]) <= 30 and 3 <= b["max_tokens"] <= 9
        assert b["temperature"] == 0.3 and "ignore_eos" not in b
        assert all(0 <= t < 10000 for t in b["prompt"])


def test_chat_endpoint(servers, tmp_path):
    s = servers()
    data = _jsonl(tmp_path, [{"prompt": "hi", "max_tokens": 5}] * 2)
    rc, r = _run(s, tmp_path, "--dataset", data, "--endpoint", "/v1/chat/completions",
                 "--ignore-eos")
    assert rc == 0 and r["output_lens"] == [5, 5]
    assert all(FIRST - 0.005 < t < FIRST + 0.1 for t in r["ttfts"])  # role chunk: no content
    b = s.stats()["bodies"][-1]
    assert b["messages"] == [{"role": "user", "content": "hi"}]
    assert b["max_completion_tokens"] == 5 and b["ignore_eos"] is True


def test_goodput(servers, tmp_path, capsys):
    s = servers()
    data = _jsonl(tmp_path, [{"prompt": "p", "max_tokens": 5}] * 3)
    rc, r = _run(s, tmp_path, "--dataset", data, "--goodput", "ttft:1000", "tpot:200",
                 "e2el:5000")
    assert rc == 0 and r["request_goodput"] == pytest.approx(3 / r["duration"])
    assert "Request goodput (req/s):" in capsys.readouterr().out
    rc, r = _run(s, tmp_path, "--dataset", data, "--goodput", "ttft:1000", "tpot:5")
    assert r["request_goodput"] == 0.0  # TPOT ≈ 20 ms misses 5 ms
    capsys.readouterr()
    rc, r = _run(s, tmp_path, "--dataset", data)
    assert r["request_goodput"] is None
    assert "Request goodput" not in capsys.readouterr().out


def test_concurrency_sweep_table_plot_and_json(servers, tmp_path, capsys):
    s = servers("--first-delay", "0.02", "--token-delay", "0.005")
    data = _jsonl(tmp_path, [{"prompt": "p", "max_tokens": 8}] * 8)
    png = tmp_path / "sweep.png"
    rc, r = _run(s, tmp_path, "--dataset", data, "--concurrency", "1,4",
                 "--prompts-per-concurrency", "2", "--plot", str(png))
    assert rc == 0
    assert [run["max_concurrency"] for run in r["runs"]] == [1, 4]
    assert [run["num_prompts"] for run in r["runs"]] == [2, 8]
    assert all(run["completed"] == run["num_prompts"] for run in r["runs"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 2
    table = out[out.index("concurrency "):].splitlines()
    assert table[1].split()[0] == "1" and table[2].split()[0] == "4"
