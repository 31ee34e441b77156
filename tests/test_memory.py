"""The run's memory as summed PSS: a child's pages count, shared pages count once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from rlray.observe.memory import GIB, MemoryMonitor, pss_bytes, total_pss_bytes, with_descendants

MIB = 1024**2

# Touches 256 MiB, then forks: parent and child share those pages copy-on-write.
TOUCH_AND_FORK = """
import os, sys
block = b"x" * (256 << 20)
if os.fork() == 0:
    sys.stdin.read()
    os._exit(0)
print("ready", flush=True)
sys.stdin.read()
"""


def start_ready(code: str) -> subprocess.Popen:
    """Starts Python on `code`, talking over pipes, once it has printed "ready"."""
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "ready"
    return process


@pytest.fixture
def forked_pair():
    process = start_ready(TOUCH_AND_FORK)
    deadline = time.monotonic() + 30
    while len(with_descendants([process.pid])) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    yield process
    process.stdin.close()
    process.wait(timeout=30)


def test_a_process_tree_counts_its_children_and_shared_pages_once(forked_pair):
    pids = with_descendants([forked_pair.pid])
    assert len(pids) == 2  # the parent and its forked child
    total = total_pss_bytes([forked_pair.pid])
    # Each holds the 256 MiB block in its resident set; PSS charges half of it to each.
    assert 256 * MIB <= total < 400 * MIB, total / MIB
    assert all(pss_bytes(pid) >= 128 * MIB for pid in pids)


def test_a_gone_process_has_no_size():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert pss_bytes(process.pid) is None
    assert with_descendants([process.pid]) == set()


def test_the_monitor_keeps_the_last_and_the_peak(forked_pair):
    monitor = MemoryMonitor(lambda: [forked_pair.pid], interval_s=0.1).start()
    try:
        deadline = time.monotonic() + 30
        while monitor.peak_bytes is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        monitor.stop()
    # This test's process and the forked pair.
    assert monitor.peak_bytes >= monitor.last_bytes > 256 * MIB
    assert monitor.peak_bytes < 64 * GIB


# Grows by 128 MiB of touched pages at each line it reads.
GROW_ON_EACH_LINE = """
import sys
blocks = []
print("ready", flush=True)
for line in sys.stdin:
    blocks.append(b"x" * (128 << 20))
    print("grown", flush=True)
"""


def test_the_monitor_measures_pss_again_when_resident_memory_grows():
    process = start_ready(GROW_ON_EACH_LINE)
    try:
        monitor = MemoryMonitor(lambda: [process.pid], refresh_s=3600)
        monitor.look()  # the first look measures
        monitor.look()  # nothing grew: no measurement
        assert monitor.samples == 1
        first_peak = monitor.peak_bytes
        process.stdin.write("grow\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "grown"
        monitor.look()
        assert monitor.samples == 2
        assert monitor.peak_bytes >= first_peak + 100 * MIB
        monitor.refresh_s = 0  # a measurement this old is refreshed though nothing grew
        monitor.look()
        assert monitor.samples == 3
    finally:
        process.stdin.close()
        process.wait(timeout=30)


def test_the_peak_is_split_by_process(forked_pair):
    names = {forked_pair.pid: "parent"}
    monitor = MemoryMonitor(lambda: [forked_pair.pid], names=lambda: names)
    monitor.sample()
    shares = monitor.peak_by_process
    # The named parent, its forked child as the parent's, and this process as the driver
    # (with whatever else it started by its own names: in the suite, the session's Ray).
    assert {"parent", "parent child", "driver"} <= set(shares), shares
    assert shares["parent"] >= 128 * MIB and sum(shares.values()) == monitor.peak_bytes
    assert list(shares.values()) == sorted(shares.values(), reverse=True)


def test_the_kv_cache_is_sized_to_a_rollout_batch():
    from rlray.config import Config
    from rlray.data.models import resolve_model_path
    from rlray.rollout.worker import kv_cache_bytes, vllm_env

    config = Config()
    path = resolve_model_path(config.model.path)
    # The embedded model: 2 layers, 2 KV heads of 64 dims, float32; keys and values for
    # 64 prompts x 4 samples at 64 tokens, in one 64-token block each:
    # 256 * 64 * (2 * 2 * 2 * 64 * 4) bytes.
    assert kv_cache_bytes(path, config.model, config.rollout) == 256 * 64 * 2048 == 32 * MIB
    config.model.dtype = "bfloat16"
    config.rollout.samples_per_prompt = 8
    assert kv_cache_bytes(path, config.model, config.rollout) == 32 * MIB
    config.model.max_model_len = 80  # a block of 96 tokens: the multiple of 32 that holds it
    assert kv_cache_bytes(path, config.model, config.rollout) == 48 * MIB
    config.model.max_model_len = 272  # three 128-token blocks a sequence
    assert kv_cache_bytes(path, config.model, config.rollout) == 3 * 64 * MIB
    # A size in GiB still overrides it, through vLLM's CPU environment variable.
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(config.rollout)
    config.rollout.kv_cache_gib = 2
    assert vllm_env(config.rollout)["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_engine_arguments_follow_the_rollout_settings():
    from rlray.config import Config
    from rlray.data.models import resolve_model_path
    from rlray.rollout.worker import engine_arguments

    config = Config()
    path = resolve_model_path(config.model.path)
    rollout = config.rollout
    # The default CPU worker: a KV cache sized to its batch, in 64-token blocks; no
    # prefill split across engine steps (seeded sampling fails on it there).
    assert engine_arguments(path, config.model, rollout, sleep_mode=False) == {
        "block_size": 64,
        "kv_cache_memory_bytes": 32 * MIB,
        "enable_chunked_prefill": False,
    }
    rollout.kv_cache_gib = 2  # vLLM's CPU variable sizes it instead
    assert "kv_cache_memory_bytes" not in engine_arguments(path, config.model, rollout, False)
    # Turns and in-flight loads must not split a prefill; kept KV may not be reused.
    rollout.in_flight_updates, rollout.in_flight_kv_cache = True, "keep"
    args = engine_arguments(path, config.model, rollout, False)
    assert args["enable_chunked_prefill"] is False and args["enable_prefix_caching"] is False
    rollout.in_flight_kv_cache = "recompute"
    assert "enable_prefix_caching" not in engine_arguments(path, config.model, rollout, False)
    # On a GPU: its memory share and sleep mode; tensor parallel ranks as Ray actors,
    # vLLM choosing the block size.
    rollout.gpus_per_worker, rollout.tensor_parallel_size = 2, 2
    args = engine_arguments(path, config.model, rollout, sleep_mode=True)
    assert args["enable_sleep_mode"] is True
    assert args["gpu_memory_utilization"] == rollout.gpu_memory_utilization
    assert args["tensor_parallel_size"] == 2 and args["distributed_executor_backend"] == "ray"
    assert "block_size" not in args
    # There a long prefill may be split (chunked prefill), but not in multi-turn runs.
    rollout.in_flight_updates = False
    assert "enable_chunked_prefill" not in engine_arguments(path, config.model, rollout, False)
    rollout.environment = "builtin:calculator"
    assert engine_arguments(path, config.model, rollout, False)["enable_chunked_prefill"] is False


# Fills the heap with 256 blocks of 96 KiB (below glibc's mmap threshold), frees all
# but the last, which keeps the heap's top in place, then calls the trimmer.
TRIM_FREED_HEAP = """
import ctypes, ctypes.util, sys
from rlray.rollout.worker import heap_trimmer
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
blocks = [libc.malloc(96 << 10) for _ in range(256)]
for block in blocks:
    ctypes.memset(block, 1, 96 << 10)
for block in blocks[:-1]:
    libc.free(ctypes.c_void_p(block))
before = rss()
heap_trimmer(sys.argv[1])()
print(before - rss())
"""


def test_a_small_models_rollout_worker_gives_its_free_heap_back(tmp_path):
    from rlray.config import Config
    from rlray.data.models import resolve_model_path
    from rlray.rollout.worker import KEEP_HEAP_FROM_WEIGHT_BYTES, heap_trimmer

    small = resolve_model_path(Config().model.path)
    assert heap_trimmer(small) is not None
    # A model whose weights a reload would reuse the heap for keeps it (a sparse file of
    # that size), as does one named on the hub, whose size is not read here.
    large = tmp_path / "large"
    large.mkdir()
    with open(large / "model.safetensors", "wb") as weights:
        weights.truncate(KEEP_HEAP_FROM_WEIGHT_BYTES)
    assert heap_trimmer(str(large)) is None
    assert heap_trimmer("Qwen/Qwen2.5-0.5B") is None
    # The trim itself: ~24 MiB freed inside the heap go back to the system.
    done = subprocess.run(
        [sys.executable, "-c", TRIM_FREED_HEAP, small], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 16 * MIB


def test_the_driver_and_small_actors_do_not_import_torch(tmp_path):
    # Every actor process imports its Ray face (rlray.cluster) (Ray finds actor classes by module);
    # torch and transformers would add ~300 MB of private memory to each of them. The
    # driver also writes TensorBoard files all run long.
    code = (
        "import sys, pathlib, rlray.cluster.connection, rlray.cluster.start, "
        "rlray.driver.training; "
        "from rlray.observe.tracking import Trackers; "
        f"Trackers(pathlib.Path({str(tmp_path)!r}), {{}}, 'x', False).close(); "
        "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_prompt_lengths_are_counted_as_the_tokenizer_counts_them():
    from rlray.config import Config
    from rlray.data.models import load_tokenizer, prompt_token_counts, resolve_model_path

    path = resolve_model_path(Config().model.path)
    prompts = ["12+34=", "1+2=", "99 * (3-1) ="]
    expected = [len(ids) for ids in load_tokenizer(path)(prompts).input_ids]
    assert expected[:2] == [6, 4]  # one token per character
    assert prompt_token_counts(path, prompts) == expected  # counted in a child process


def test_prompt_readings_are_cached_under_the_tokenizer_files_and_prompts(tmp_path, monkeypatch):
    from rlray.config import Config
    from rlray.data.models import _readings_cache_file, read_prompts, resolve_model_path

    model = tmp_path / "model"
    shutil.copytree(resolve_model_path(Config().model.path), model)
    monkeypatch.setenv("RLRAY_CACHE_DIR", str(tmp_path / "cache"))
    entries = tmp_path / "cache" / "prompt-readings"
    first = read_prompts(str(model), [["12+34="], ["1+2="]])
    assert [[t.count for t in read] for read in first] == [[6], [4]]
    (entry,) = entries.glob("*.json")
    # A second run is served from the entry (edited here to show it is what was read).
    entry.write_text(json.dumps([[[60, None]], [[40, None]]]))
    assert [
        [t.count for t in read] for read in read_prompts(str(model), [["12+34="], ["1+2="]])
    ] == [
        [60],
        [40],
    ]
    # Other prompts are read again by the tokenizer, under an entry of their own...
    assert read_prompts(str(model), [["12+3="], ["1+2="]])[0][0].count == 5
    assert len(list(entries.glob("*.json"))) == 2
    # ...and so are these prompts after a tokenizer file changed (its key is another),
    # but not after a change to the weights, which the tokenizer never reads.
    key = _readings_cache_file(str(model), [["12+34="], ["1+2="]])
    assert key == entry
    (model / "model.safetensors").write_bytes(b"other weights")
    assert _readings_cache_file(str(model), [["12+34="], ["1+2="]]) == entry
    config = model / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    assert _readings_cache_file(str(model), [["12+34="], ["1+2="]]) not in (entry, None)
