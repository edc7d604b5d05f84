"""``python -m bench.big_gguf``: loading a 7B-shaped GGUF, ours against llama.cpp, in memory and time.

The bound measured: a GGUF is never materialised as float32, so loading and serving a file peaks
at no more than the file's size + 1.5 GB of resident memory (plus the KV cache), and the cache
the first load fills takes at most the file's size on disk.

``--write`` (the default when the file is missing) writes ``results/qwen2.5-7b-shaped-q4_k_m.gguf``:
Qwen2.5-7B's shapes (architecture ``qwen2``, hidden 3584, 28 layers, 28 heads, 4 KV heads,
intermediate 18944, 152,064 rows, q/k/v biases, an untied output) with random but valid blocks in
llama-quantize's Q4_K_M layout: Q4_K for most matrices and the token embedding, Q6_K for the
output and for ``attn_v``/``ffn_down`` in the layers of :func:`more_bits`; F32 norms and biases.
Each block's fp16 ``d``/``dmin`` is uniform in 1e-4..1e-3 so that activations stay finite. The
tokenizer is the embedded Qwen2.5-Coder target's (every ``tokenizer.*`` key copied), its 151,936
tokens padded to the 152,064 rows with ``[PAD{i}]`` tokens as llama.cpp's converter pads
Qwen2.5-7B's. Tensors are written one at a time (at most one, the 447 MB output, in memory).

``--measure`` loads the file the way the app does
(``engine.models.loading.load_model(path, torch.float32, "cpu", False, "auto")``) in a fresh
process each time: the first load (an empty ``SEQUOIA_CACHE``, the file evicted from the page cache)
and the warm load (the same cache again), then serves one token and 16 more through the engine's
runner. Each reports its peak RSS (``VmHWM``), that of a bare interpreter that imported torch,
transformers and the engine (same process, before loading), the RSS sampled every 20 ms, and the
wall time. llama.cpp's ``llama-bench -p 0 -n 16 -t 2 -r 1`` loads the same file under
``/usr/bin/time -v`` (max RSS; load time from its progress lines). A table is printed and JSON
saved to ``results/big-gguf-*.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PATH = ROOT / "results" / "qwen2.5-7b-shaped-q4_k_m.gguf"
BOUND_EXTRA = 1.5e9  # bytes of RSS allowed above the file's size
SCALE_RANGE = (1e-4, 1e-3)  # each block's fp16 d and dmin


@dataclass(frozen=True)
class Shape:
    """A qwen2 model's sizes (the defaults: Qwen2.5-7B's)."""

    layers: int = 28
    hidden: int = 3584
    heads: int = 28
    kv_heads: int = 4
    intermediate: int = 18944
    rows: int = 152064  # token embedding and output rows
    context: int = 32768
    rope_theta: float = 1e6
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


QWEN25_7B = Shape()


def more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's ``use_more_bits``: Q4_K_M gives ``attn_v`` and ``ffn_down`` Q6_K in the first
    and last eighth of the layers and every third layer between them."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(shape: Shape) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, type, numpy shape)`` of every tensor, in the order written: matrices ``(rows, cols)``,
    types ``"Q4_K"``, ``"Q6_K"`` or ``"F32"``."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    plan = [("token_embd.weight", "Q4_K", (shape.rows, h))]
    for i in range(shape.layers):
        extra = "Q6_K" if more_bits(i, shape.layers) else "Q4_K"
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", "F32", (h,)),
                 (b + "attn_q.weight", "Q4_K", (h, h)), (b + "attn_q.bias", "F32", (h,)),
                 (b + "attn_k.weight", "Q4_K", (kv, h)), (b + "attn_k.bias", "F32", (kv,)),
                 (b + "attn_v.weight", extra, (kv, h)), (b + "attn_v.bias", "F32", (kv,)),
                 (b + "attn_output.weight", "Q4_K", (h, h)), (b + "ffn_norm.weight", "F32", (h,)),
                 (b + "ffn_gate.weight", "Q4_K", (shape.intermediate, h)),
                 (b + "ffn_up.weight", "Q4_K", (shape.intermediate, h)),
                 (b + "ffn_down.weight", extra, (h, shape.intermediate))]
    return plan + [("output_norm.weight", "F32", (h,)), ("output.weight", "Q6_K", (shape.rows, h))]


def random_data(kind: str, dims: tuple[int, ...], name: str, rng: np.random.Generator) -> np.ndarray:
    """A tensor's data: F32 norms of 1 and biases of 0.01 N(0, 1); K blocks ``[rows, row bytes]``
    of random bytes whose fp16 super-block scales (``d``, and ``dmin`` for Q4_K) are uniform in
    :data:`SCALE_RANGE`, so every block is valid and finite."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if kind == "F32":
        return np.ones(dims, np.float32) if name.endswith("norm.weight") else \
            (0.01 * rng.standard_normal(dims)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    rows, blocks = dims[0], dims[1] // block
    data = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    for offset in ((0, 2) if qtype == GGMLQuantizationType.Q4_K else (208,)):
        scales = rng.uniform(*SCALE_RANGE, size=(rows, blocks)).astype(np.float16)
        data[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, blocks * size)


def copy_tokenizer(writer, source: Path, rows: int) -> int:
    """Every ``tokenizer.*`` key of the GGUF ``source`` into ``writer``, with its value types, the
    token list padded to ``rows`` with ``[PAD{i}]`` tokens of type UNUSED as llama.cpp's converter
    pads Qwen2.5-7B's (llama.cpp refuses an embedding of more rows than tokens); the number of
    tokens ``source`` has."""
    from gguf import TokenType

    from engine.backends.gguf_file import MetadataReader, read_metadata

    fields, values = MetadataReader(source).fields, read_metadata(source)
    tokens = len(values["tokenizer.ggml.tokens"])
    padding = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(tokens, rows)],
               "tokenizer.ggml.token_type": [int(TokenType.UNUSED)] * (rows - tokens),
               "tokenizer.ggml.scores": [0.0] * (rows - tokens)}
    for key, value in values.items():
        if key.startswith("tokenizer."):
            types = fields[key].types
            value = value + padding[key] if key in padding else value
            writer.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)
    return tokens


def write_big_gguf(path: Path = DEFAULT_PATH, shape: Shape = QWEN25_7B, seed: int = 0,
                   tokenizer_from: Path | None = None, name: str = "Qwen2.5-7B-shaped random Q4_K_M") -> Path:
    """Write the qwen2 GGUF of ``shape`` (see the module docstring) to ``path`` (through a
    ``.partial`` file, renamed once whole); the tokenizer is ``tokenizer_from``'s (default: the
    embedded target's GGUF). Returns ``path``."""
    import gguf

    if tokenizer_from is None:
        from engine.models.loading import DEFAULT_TARGET, assemble_gguf
        tokenizer_from = assemble_gguf(DEFAULT_TARGET)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), "qwen2")
    writer.add_name(name)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    copy_tokenizer(writer, Path(tokenizer_from), shape.rows)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    plan = tensor_plan(shape)
    for tensor_name, kind, dims in plan:
        qtype = gguf.GGMLQuantizationType[kind]
        byte_shape = gguf.quant_shape_to_byte_shape(dims, qtype) if kind != "F32" else dims
        nbytes = int(np.prod(byte_shape)) * (4 if kind == "F32" else 1)
        writer.add_tensor_info(tensor_name, byte_shape, np.dtype(np.float32 if kind == "F32" else np.uint8),
                               nbytes, raw_dtype=None if kind == "F32" else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tensor_name, kind, dims in plan:  # one tensor in memory at a time
        writer.write_tensor_data(random_data(kind, dims, tensor_name, rng))
    writer.close()
    os.replace(partial, path)
    return path


# ----- measuring ---------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler(threading.Thread):
    """This process's RSS every ``every`` seconds, its maximum and the phase it was reached in."""

    def __init__(self, every: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.every, self.phase, self.peaks = every, "start", {}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every):
            rss = _rss()
            if rss > self.peaks.get(self.phase, 0):
                self.peaks[self.phase] = rss

    def stop(self) -> dict[str, int]:
        self._done.set()
        self.join()
        return self.peaks


def evict(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (``posix_fadvise DONTNEED``; no privileges needed)."""
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def child(path: Path, out: Path) -> None:
    """In a process of its own: load ``path`` as the app does and serve 1 then 16 tokens; write the
    figures (bytes, seconds) to ``out`` as JSON."""
    sampler = RssSampler()
    sampler.start()
    import torch
    import transformers  # noqa: F401 - the bare interpreter the bound is measured above

    import engine.backends.kquant_model  # noqa: F401
    import engine.models.gguf_direct  # noqa: F401
    from engine.core.runner import DynamicRunner
    from engine.models.loading import load_model

    bare = _status_kb("VmHWM")
    sampler.phase = "load"
    start = time.perf_counter()
    model, tokenizer = load_model(str(path), torch.float32, "cpu", False, "auto")
    load_s = time.perf_counter() - start
    loaded = _status_kb("VmHWM")
    sampler.phase = "serve"
    runner = DynamicRunner(model)
    ids = tokenizer.encode("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b")
    times = {}
    with torch.no_grad():
        for name, start_slot, tokens in (("t_1_token_s", 0, ids[:1]), ("t_16_tokens_s", 1, (ids * 16)[1:17])):
            start = time.perf_counter()
            logits = runner.forward(tokens, start_slot)
            times[name] = time.perf_counter() - start
            times[name.replace("_s", "_finite")] = bool(torch.isfinite(logits).all())
    figures = {"bare_hwm": bare, "load_hwm": loaded, "hwm": _status_kb("VmHWM"), "rss_end": _rss(),
               "load_s": load_s, **times, "sampled_peaks": sampler.stop()}
    out.write_text(json.dumps(figures))


def run_child(path: Path, cache: Path, timeout: float = 1800) -> dict:
    """:func:`child` in a fresh interpreter with ``SEQUOIA_CACHE=cache``; its figures plus its wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        env = {**os.environ, "SEQUOIA_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "bench.big_gguf", "--child", str(path), "--out", str(out)],
                              cwd=ROOT, env=env, timeout=timeout, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"loading {path.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return {**json.loads(out.read_text()), "process_s": wall}


def disk_bytes(directory: Path) -> int:
    """Bytes the files under ``directory`` take on disk (``du``: allocated blocks), links not followed."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            file = Path(root, name)
            if not file.is_symlink():
                total += file.lstat().st_blocks * 512
    return total


def fresh_cache(parent: Path) -> Path:
    """An empty ``SEQUOIA_CACHE`` that shares only the compiled kernels of the usual cache (built
    first, so that no load below waits for a compiler)."""
    from engine.user_cache import cache_dir

    subprocess.run([sys.executable, "-c", "from engine.kernels.build import compiled_kernels; compiled_kernels()"],
                   cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    cache = Path(tempfile.mkdtemp(prefix="big-gguf-cache-", dir=parent))
    (cache / "kernels").symlink_to(cache_dir() / "kernels", target_is_directory=True)
    return cache


def llama_cpp(path: Path, cold: bool, timeout: float = 1800) -> dict | None:
    """llama.cpp's ``llama-bench -p 0 -n 16 -t 2 -r 1`` on ``path`` under ``/usr/bin/time -v``: its max
    RSS, wall time, load time (from its "starting" progress line to its first run's) and tokens/s.
    None when llama.cpp is not built."""
    from bench.peer.llama_cpp import peer_binaries

    binaries, _ = peer_binaries()
    if binaries is None or not Path("/usr/bin/time").exists():
        return None
    if cold:
        evict(path)
    command = ["/usr/bin/time", "-v", str(binaries.bench), "-m", str(path), "-p", "0", "-n", "16", "-t", "2",
               "-r", "1", "--progress", "-o", "json"]
    start, marks, lines = time.perf_counter(), {}, []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        reader = threading.Thread(target=lambda: lines.append(process.stdout.read()), daemon=True)
        reader.start()
        for line in process.stderr:
            lines.append(line)
            for mark in ("starting", "warmup", "generation run"):
                if f": {mark}" in line and mark not in marks:
                    marks[mark] = time.perf_counter() - start
        process.wait(timeout)
        reader.join()
    text = "".join(lines)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    report = re.search(r"\[\s*\{.*\}\s*\]", text, re.S)
    speed = json.loads(report.group(0))[0]["avg_ts"] if report else None
    return {"max_rss": int(rss.group(1)) * 1024 if rss else None, "process_s": time.perf_counter() - start,
            "load_s": marks["warmup"] - marks["starting"] if {"warmup", "starting"} <= marks.keys() else None,
            "tokens_per_s_16": speed, "cold": cold}


def measure(path: Path, results: Path, keep_cache: bool = False, peer: bool = True) -> dict:
    """Our first and warm loads of ``path`` and llama.cpp's (see the module docstring): the report."""
    size = path.stat().st_size
    cache = fresh_cache(results)
    try:
        evict(path)
        first = run_child(path, cache)
        first_disk = disk_bytes(cache)
        warm = run_child(path, cache)
        report = {"file": str(path), "file_bytes": size, "bound_bytes": size + BOUND_EXTRA,
                  "first": first, "warm": warm, "cache_disk_bytes": first_disk,
                  "cache_disk_after_warm_bytes": disk_bytes(cache)}
    finally:
        if not keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    if peer:
        report["llama_cpp_first"] = llama_cpp(path, cold=True)
        report["llama_cpp_warm"] = llama_cpp(path, cold=False)
    return report


def _gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.2f} GB"


def _s(value) -> str:
    return "-" if value is None else f"{value:.1f} s"


def table(report: dict) -> str:
    """The report as a few aligned lines."""
    size = report["file_bytes"]
    lines = [f"file {Path(report['file']).name}: {_gb(size)}; bound: peak RSS <= {_gb(report['bound_bytes'])}, "
             f"cache disk <= {_gb(size)}",
             f"{'':22}{'load':>9}{'process':>10}{'peak RSS':>11}{'above bare':>12}{'1 token':>9}{'16 tokens':>10}"]
    for key in ("first", "warm"):
        r = report[key]
        lines.append(f"{'ours, ' + key:22}{_s(r['load_s']):>9}{_s(r['process_s']):>10}{_gb(r['hwm']):>11}"
                     f"{_gb(r['hwm'] - r['bare_hwm']):>12}{_s(r['t_1_token_s']):>9}{_s(r['t_16_tokens_s']):>10}")
    for key in ("llama_cpp_first", "llama_cpp_warm"):
        r = report.get(key)
        if r:
            tokens = f"{16 / r['tokens_per_s_16']:.1f} s" if r["tokens_per_s_16"] else "-"
            lines.append(f"{key.replace('_', '.', 1).replace('_', ', '):22}{_s(r['load_s']):>9}"
                         f"{_s(r['process_s']):>10}{_gb(r['max_rss']):>11}{'':>12}{'':>9}{tokens:>10}")
    lines.append(f"cache disk after the first load: {_gb(report['cache_disk_bytes'])} "
                 f"(after the warm one: {_gb(report['cache_disk_after_warm_bytes'])}); bare interpreter "
                 f"{_gb(report['first']['bare_hwm'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(prog="python -m bench.big_gguf", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, default=DEFAULT_PATH, help="the GGUF file (default: %(default)s)")
    parser.add_argument("--write", action="store_true", help="(re)write the file even if it exists")
    parser.add_argument("--measure", action="store_true", help="measure loading it, ours and llama.cpp's")
    parser.add_argument("--layers", type=int, default=QWEN25_7B.layers, help="layers of the written file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    parser.add_argument("--keep-cache", action="store_true", help="keep the temporary SEQUOIA_CACHE")
    parser.add_argument("--out", type=Path, default=None, help="where the JSON goes (default: results/)")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child, args.out)
        return None
    if args.write or not args.path.exists():
        start = time.perf_counter()
        write_big_gguf(args.path, Shape(layers=args.layers), args.seed)
        print(f"wrote {args.path} ({_gb(args.path.stat().st_size)}) in {time.perf_counter() - start:.0f} s")
    if not args.measure:
        return None
    results = (args.out.parent if args.out else ROOT / "results")
    results.mkdir(parents=True, exist_ok=True)
    report = measure(args.path, results, args.keep_cache, not args.no_peer)
    out = args.out or results / f"big-gguf-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=2))
    print(table(report))
    print(f"saved {out}")
    return report


if __name__ == "__main__":
    main()
