"""vLLM on kvdaemon, end to end, on a GPU machine with vLLM 0.33 installed.

Run from the repository root, with kvdaemon installed in vLLM's environment
(``pip install -e '.[cuda]'`` next to ``vllm==0.33.*``)::

    python bench/vllm_smoke.py [--capacity 4GiB]

A tiny Llama from a local config (random weights: ``load_format="dummy"``, no
tokenizer, prompts as token ids) is served by vLLM's ``LLM``, each run in its
own process (vLLM loads its plugins once per process):

- ``baseline``: without the plugin (``KVDAEMON_VLLM_TENANT`` unset);
- ``plugin``: as tenant ``smoke-a`` of a daemon: greedy outputs must equal the
  baseline's; then ``kvdaemon sleep`` (warm) between two generates, whose
  second (a prefix-cache hit on restored KV) must equal the first; then a
  cold sleep, after which outputs (recomputed) must still be equal;
- ``shared``: two engines (``smoke-a``, ``smoke-b``) on one daemon at once,
  both equal to the baseline, both seen in ``kvdaemon status`` meanwhile.

Prints ``PASS``/``FAIL`` per check and the plugin's generate time over the
baseline's (a ratio from the same run); writes ``bench/results/vllm_smoke.json``.
Exit status 0 when every check passed. Cost: about a minute per engine start
on one GPU, well under 2 GiB of device memory per engine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_proc import daemon_process  # noqa: E402
from report import save  # noqa: E402

MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "num_hidden_layers": 4, "vocab_size": 2048, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
PROMPT_LENGTHS = (5, 77, 300, 16, 129, 512, 33, 64)
MAX_TOKENS = 32


def prompts() -> list[list[int]]:
    """Fixed token-id prompts, a shared 48-token prefix on half of them (prefix caching)."""
    prefix = [(i * 37) % 2000 + 10 for i in range(48)]
    out = []
    for n, length in enumerate(PROMPT_LENGTHS):
        body = [(n * 7919 + i * 31) % 2000 + 10 for i in range(length)]
        out.append(prefix + body if n % 2 else body)
    return out


# -- one engine (a child process) ---------------------------------------------------


def engine_main(args: argparse.Namespace) -> None:
    """Generate greedily, optionally sleeping the tenant between generates; write a JSON report."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
        max_model_len=1024, enforce_eager=True, enable_prefix_caching=True,
        gpu_memory_utilization=0.15, kv_cache_memory_bytes=256 << 20,  # the plugin replaces the latter
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts()]

    def generate() -> tuple[list[list[int]], float]:
        started = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - started

    generate()  # warm-up: first-call costs stay out of the timing
    report: dict[str, Any] = {}
    report["outputs"], report["generate_s"] = generate()
    tenant = os.environ.get("KVDAEMON_VLLM_TENANT")
    if tenant and args.sleep:
        from kvdaemon.client import KVClient

        with KVClient(os.environ["KVDAEMON_DIR"]) as client:
            for mode in ("warm", "cold"):
                client.sleep(tenant, mode=mode)
                row = next(t for t in client.status()["tenants"] if t["name"] == tenant)
                report[f"{mode}_state"], report[f"{mode}_mapped_bytes"] = row["state"], row["mapped_bytes"]
                report[f"after_{mode}"], _ = generate()  # the first step wakes the tenant
    Path(args.out).write_text(json.dumps(report))


def run_engine(model: Path, out: Path, tenant: str | None, kvd_dir: Path | None, sleep: bool = False) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVDAEMON_VLLM_TENANT", "KVDAEMON_DIR")}
    if tenant is not None and kvd_dir is not None:
        env.update(KVDAEMON_VLLM_TENANT=tenant, KVDAEMON_DIR=str(kvd_dir))
    command = [sys.executable, __file__, "engine", "--model", str(model), "--out", str(out)]
    return subprocess.Popen(command + (["--sleep"] if sleep else []), env=env)


def finish(proc: subprocess.Popen[bytes], out: Path, what: str) -> dict[str, Any]:
    if proc.wait(900) != 0:
        raise SystemExit(f"the {what} engine exited with {proc.returncode}")
    return json.loads(out.read_text())


# -- the checks ----------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", default="4GiB", help="the daemon's capacity")
    parser.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    args = parser.parse_args()
    if find_spec("vllm") is None:
        print("vLLM is not installed here: pip install 'vllm==0.33.*' (it needs a CUDA GPU and torch 2.14)")
        return 2
    work = Path(tempfile.mkdtemp(prefix="vllm-smoke-"))
    model = work / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL))
    checks: dict[str, bool] = {}
    figures: dict[str, Any] = {}

    baseline = finish(run_engine(model, work / "baseline.json", None, None), work / "baseline.json", "baseline")
    expected = baseline["outputs"]
    with daemon_process(args.capacity, backend=args.backend) as client:
        plugin = finish(run_engine(model, work / "a.json", "smoke-a", client.dir, sleep=True), work / "a.json", "plugin")
        checks["outputs_equal_without_plugin"] = plugin["outputs"] == expected
        checks["warm_sleep_frees_pages"] = plugin["warm_state"] == "sleeping-warm" and plugin["warm_mapped_bytes"] == 0
        checks["outputs_equal_after_warm_wake"] = plugin["after_warm"] == expected
        checks["cold_sleep_frees_pages"] = plugin["cold_state"] == "sleeping-cold" and plugin["cold_mapped_bytes"] == 0
        checks["outputs_equal_after_cold_wake"] = plugin["after_cold"] == expected
        figures["plugin_over_baseline_generate_time"] = round(plugin["generate_s"] / baseline["generate_s"], 3)

        seen: set[str] = set()
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.2):
                seen.update(t["name"] for t in client.status()["tenants"] if t["mapped_bytes"] > 0)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        procs = {name: run_engine(model, work / f"{name}.json", name, client.dir) for name in ("smoke-a", "smoke-b")}
        shared = {name: finish(proc, work / f"{name}.json", name) for name, proc in procs.items()}
        stop.set()
        watcher.join()
        checks["two_engines_equal_without_plugin"] = all(r["outputs"] == expected for r in shared.values())
        checks["two_engines_seen_at_once_in_status"] = seen >= {"smoke-a", "smoke-b"}

    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    for name, value in figures.items():
        print(f"     {name} = {value}")
    path = save("vllm_smoke", {"checks": checks, **figures})
    print(f"{sum(checks.values())}/{len(checks)} checks passed; figures in {path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        engine_parser = argparse.ArgumentParser()
        engine_parser.add_argument("engine")
        engine_parser.add_argument("--model", required=True)
        engine_parser.add_argument("--out", required=True)
        engine_parser.add_argument("--sleep", action="store_true")
        engine_main(engine_parser.parse_args())
    else:
        sys.exit(main())
