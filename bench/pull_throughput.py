"""Pull throughput: `localllm pull` (sha256 verified, registered) vs plain `curl` of the same file.

    .venv/bin/python bench/pull_throughput.py [--size-mb 1024] [--rounds 3] [--quick]

One GGUF of --size-mb random bytes is served by the test suite's fake hub (tests/fakehub.py) in its
own process on loopback, with sendfile. Rounds alternate: `curl -o FILE URL` (no verification),
then `localllm pull hf.co/bench/big-GGUF` as a fresh process into an empty store (resolve the
commit, download, re-read and check sha256, parse the GGUF, register). Both write to the same disk.
Reports medians of wall time and MB/s, the ratio, and the in-process time of the pull alone (without
Python start-up). Writes bench/results/pull_throughput.json. `--quick`: a 32 MB file, one round
(bench/results/quick/pull_throughput.json). Without curl on the PATH its part is skipped (its
figures null, `curl_skipped` says why) and the pull is still measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import save

ROOT = Path(__file__).resolve().parents[1]
REPO = "bench/big-GGUF"
NAME = "big-Q8_0.gguf"


def make_gguf(path: Path, size_mb: int) -> None:
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("bench-big")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    n = size_mb << 20
    w.add_tensor("blob.weight", rng.integers(-128, 127, size=n, dtype=np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def serve(path: str) -> None:
    """Child process: serve one file and print the hub URL and the commit."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fakehub import FakeHub

    with FakeHub() as hub:
        hub.add(REPO, NAME, Path(path))
        print(hub.url, hub.repos[REPO].commit, flush=True)
        sys.stdin.read()  # until the parent closes our stdin


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 32 MB, one round")
    ap.add_argument("--serve")
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve)
    if args.quick:
        args.size_mb, args.rounds = 32, 1
    curl_exe = shutil.which("curl")

    work = Path(tempfile.mkdtemp(prefix="pullbench-", dir=os.environ.get("BENCH_TMP")))
    try:
        src = work / "src.gguf"
        make_gguf(src, args.size_mb)
        size = src.stat().st_size
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(src)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        url, commit = server.stdout.readline().split()
        file_url = f"{url}/{REPO}/resolve/{commit}/{NAME}"
        env = os.environ | {"HF_ENDPOINT": url, "HF_HOME": str(work / "hf")}
        env.pop("HF_HUB_OFFLINE", None)
        curl_s, pull_s, pull_inproc_s = [], [], []
        for i in range(args.rounds):
            if curl_exe:
                out = work / "curl.out"
                t0 = time.perf_counter()
                subprocess.run([curl_exe, "-sSf", "-o", str(out), file_url], check=True)
                curl_s.append(time.perf_counter() - t0)
                assert out.stat().st_size == size
                out.unlink()

            home = work / f"home{i}"
            code = ("import time,sys; from localllm.models_registry.pull import pull; "
                    "t=time.perf_counter(); r=pull(sys.argv[1]); "
                    "print(time.perf_counter()-t, r.digest)")  # fmt: skip
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-c", code, f"hf.co/{REPO}:Q8_0"],
                               env=env | {"LOCALLLM_HOME": str(home)}, capture_output=True,
                               text=True)  # fmt: skip
            if p.returncode:
                raise SystemExit(p.stderr)
            pull_s.append(time.perf_counter() - t0)
            inproc, _digest = p.stdout.split()
            pull_inproc_s.append(float(inproc))
            shutil.rmtree(home)
        server.stdin.close()
        server.wait(timeout=10)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def mbps(s: float) -> float:
        return size / 1e6 / s

    pulled, inproc = (statistics.median(x) for x in (pull_s, pull_inproc_s))
    curl = statistics.median(curl_s) if curl_s else None
    result = {
        "file_bytes": size,
        "rounds": args.rounds,
        "curl_s": curl_s,
        "pull_s": pull_s,
        "pull_in_process_s": pull_inproc_s,
        "curl_MBps": round(mbps(curl), 1) if curl else None,
        "pull_MBps": round(mbps(pulled), 1),
        "pull_in_process_MBps": round(mbps(inproc), 1),
        "ratio_pull_vs_curl": round(curl / pulled, 3) if curl else None,
        "ratio_in_process_vs_curl": round(curl / inproc, 3) if curl else None,
        "what": "localllm pull (fresh process: resolve, download, sha256 re-read, GGUF parse, "
        "register) vs curl -o, same file from the fake hub on loopback",
    }
    if not curl_exe:
        result["curl_skipped"] = "curl is not installed here: only localllm pull was measured"
    save("pull_throughput", result, quick=args.quick)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
