"""Weights read off their file (engine.mapped) and the huge-page restart (engine.hugepages)."""
from __future__ import annotations

import sys

import pytest
import tiny_models as tm
import torch
from safetensors.torch import load_file, save_file

from engine.backends import hugepages
from engine.backends.kernels import pack_linears, unpack_linears
from engine.backends.mapped import _glibc, backing_file, file_mappings, own_copy, returning_freed_memory

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


@linux_only
def test_own_copy_reads_a_mapped_tensor_from_its_file(tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = {"a": torch.randn(300, 257), "b": torch.arange(10, dtype=torch.bfloat16), "c": torch.randn(3)}
    save_file(tensors, path)
    mapped = load_file(path)  # views of a private map of the file
    mappings = file_mappings()
    for name, original in tensors.items():
        source = backing_file(mapped[name], mappings)
        assert source is not None and source[0] == str(path), name
        copy = own_copy(mapped[name], mappings)
        assert torch.equal(copy, original) and copy.dtype == original.dtype, name
        assert backing_file(copy, file_mappings()) is None  # memory of its own
        assert copy.data_ptr() != mapped[name].data_ptr()


def test_own_copy_of_plain_memory_is_a_clone():
    x = torch.randn(4, 5)
    copy = own_copy(x[:, 1:])  # not contiguous: cloned, not read from anywhere
    assert torch.equal(copy, x[:, 1:]) and copy.data_ptr() != x.data_ptr()


@linux_only
def test_packing_a_mapped_model_reads_its_file(tmp_path):
    """A model whose weights are views of a safetensors map packs to the same product and holds
    nothing of the map afterwards."""
    model = tm.qwen2(seed=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    expected = model(ids).logits
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    model.load_state_dict(load_file(path), assign=True)
    assert backing_file(model.model.layers[0].mlp.up_proj.weight, file_mappings()) is not None
    pack_linears(model)
    mappings = file_mappings()
    assert all(backing_file(t, mappings) is None for t in [*model.parameters(), *model.buffers()]
               if not t.is_mkldnn)
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
    unpack_linears(model)
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_returning_freed_memory_nests():
    with returning_freed_memory():
        with returning_freed_memory():
            x = torch.empty(1 << 22)
        del x
    assert torch.ones(3).sum() == 3  # the allocator works after the settings are restored


@pytest.mark.skipif(_glibc() is None, reason="glibc's malloc only")
def test_after_loading_a_steps_buffers_are_reused_not_faulted_in_again():
    """Once a conversion is over, a decoding step's few-megabyte temporaries come back from the
    heap: allocating and freeing them again costs no page faults (it cost one per 4 KiB page when
    glibc trimmed its heap after every free)."""
    import resource

    with returning_freed_memory():
        pass

    def step() -> None:  # the sizes of a verification's logits and probabilities
        for rows in (1, 2, 3, 2, 1):
            torch.ones(rows, 151936).add_(1.0)

    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    # 20 x 2.7 MB is about 13,000 pages; trimmed after every free it took 8,000 to 13,000 faults here
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 2000


def test_restart_only_where_it_helps(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    monkeypatch.setattr(hugepages, "THP_SETTING", setting)
    setting.write_text("always madvise [never]\n")
    assert not hugepages.should_restart({})
    setting.write_text("always [madvise] never\n")
    glibc = sys.platform == "linux" and hugepages.platform.libc_ver()[0] == "glibc"
    assert hugepages.should_restart({}) == glibc
    assert not hugepages.should_restart({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert hugepages.should_restart({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == glibc
    assert not hugepages.should_restart({"SEQUOIA_HUGE_PAGES": "0"})
    setting.unlink()
    assert not hugepages.should_restart({})


@pytest.mark.skipif(not hugepages.huge_pages_requested() and not hugepages.should_restart(),
                    reason="no transparent huge pages on request here")
def test_entry_point_restarts_with_the_tunable(tmp_path):
    """A real entry point (engine.cli.generate --help) restarts itself with the tunable and still runs."""
    import os
    import subprocess

    script = tmp_path / "probe.py"
    script.write_text("import os, sys\nfrom engine.backends.hugepages import restart_with_huge_pages\n"
                      "restart_with_huge_pages()\nprint(os.environ.get('GLIBC_TUNABLES', ''), sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = os.getcwd()
    out = subprocess.run([sys.executable, str(script), "x", "--y"], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "glibc.malloc.hugetlb=1" in out and "['x', '--y']" in out
