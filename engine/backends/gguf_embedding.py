"""A token embedding kept in its GGUF blocks, dequantised a few rows at a time.

The embedded pair's float32 embeddings are the largest tensors left once the linear layers are
quantised: 151,936 rows of 1,536 (target, 933 MB) and of 896 (draft, 545 MB) float32 values.
Their GGUF blocks take 131 MB (Q4_K) and 94 MB (Q5_0). A forward only needs the rows of the
tokens it embeds, so :class:`GGUFEmbedding` keeps the blocks and dequantises those rows with
``gguf.quants.dequantize``, the function transformers' GGUF loader dequantises the whole tensor
with (``transformers/modeling_gguf_pytorch_utils.py``; no permutation applies to ``token_embd``
for qwen2/llama-style models). Each block is dequantised on its own, element by element, so a
row is bit-identical to the same row of the float32 embedding transformers built.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from engine.backends.gguf_file import GGUFTensor, read_blocks, tensor_table

TOKEN_EMBEDDING = "token_embd.weight"
REMEMBERED_ROWS = 4096  # dequantised rows kept for the short inputs of decoding steps
SHORT_INPUT = 64  # inputs of at most this many tokens go through the remembered rows


class GGUFEmbedding(torch.nn.Module):
    """``nn.Embedding`` whose weight ``[num_embeddings, embedding_dim]`` stays in GGUF blocks.

    ``blocks``: the raw bytes of the GGUF tensor, ``[num_embeddings, bytes per row]`` uint8 (one
    row of blocks per token). A C-contiguous array that owns its memory is taken over and made
    read-only; anything else (a view, a memory map of the file) is copied first, so the module
    never keeps a file mapped.
    ``forward``: ``input_ids [...]`` (integers in ``[0, num_embeddings)``) -> float32
    ``[..., embedding_dim]`` on ``input_ids``' device; the rows are dequantised on the CPU. A decoding
    step's few tokens go through the ``REMEMBERED_ROWS`` most recently dequantised rows (dequantising
    one row costs about 0.35 ms of numpy calls, a tenth of a draft level on 2 cores).

    The blocks are not a buffer: ``.to()``, ``state_dict`` and
    :func:`engine.backends.kernels.own_memory` leave them alone, and a deep copy shares them.
    """

    def __init__(self, blocks: np.ndarray, qtype: GGMLQuantizationType, embedding_dim: int) -> None:
        super().__init__()
        qtype = GGMLQuantizationType(qtype)
        row_bytes = quant_shape_to_byte_shape((embedding_dim,), qtype)[-1]
        if blocks.ndim != 2 or blocks.dtype != np.uint8 or blocks.shape[1] != row_bytes:
            raise ValueError(f"{qtype.name} rows of {embedding_dim} values take {row_bytes} bytes: "
                             f"got blocks {blocks.dtype} {tuple(blocks.shape)}")
        if blocks.base is not None or not blocks.flags.c_contiguous:
            blocks = np.array(blocks, order="C")  # memory of its own (np.array of a memmap is a plain array)
        blocks.flags.writeable = False  # frozen: deep copies share it
        self.blocks = blocks
        self.qtype = qtype
        self.num_embeddings, self.embedding_dim = int(blocks.shape[0]), int(embedding_dim)
        self._rows: OrderedDict[int, torch.Tensor] = OrderedDict()  # token -> its float32 row, least recent first
        self._rows_lock = threading.Lock()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.detach().to("cpu", torch.int64).reshape(-1)
        shape = (*input_ids.shape, self.embedding_dim)
        if ids.numel() == 0:
            return torch.empty(shape, dtype=torch.float32, device=input_ids.device)
        if int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings:
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got "
                             f"{int(ids.min())}..{int(ids.max())}")
        if ids.numel() > SHORT_INPUT:
            return self._dequantised(ids).reshape(shape).to(input_ids.device)
        return self._remembered(ids.tolist()).reshape(shape).to(input_ids.device)

    def _dequantised(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``[len(ids), embedding_dim]`` of ``ids [n]``, dequantised now."""
        return torch.from_numpy(dequantize(self.blocks[ids.numpy()], self.qtype))  # fancy indexing copies

    def _remembered(self, ids: list[int]) -> torch.Tensor:
        """Rows ``[len(ids), embedding_dim]``, dequantising only those not remembered (the same bits:
        a row is dequantised on its own either way)."""
        with self._rows_lock:
            missing = sorted({token for token in ids if token not in self._rows})
            if missing:
                for token, row in zip(missing, self._dequantised(torch.tensor(missing))):
                    self._rows[token] = row
            for token in ids:
                self._rows.move_to_end(token)
            rows = torch.stack([self._rows[token] for token in ids])
            while len(self._rows) > REMEMBERED_ROWS:
                self._rows.popitem(last=False)
        return rows

    @property
    def nbytes(self) -> int:
        """Bytes the blocks take (the float32 embedding takes ``4 * rows * dim``)."""
        return int(self.blocks.nbytes)

    def __deepcopy__(self, memo: dict) -> GGUFEmbedding:
        twin = GGUFEmbedding(self.blocks, self.qtype, self.embedding_dim)  # read-only blocks: shared
        twin.train(self.training)
        memo[id(self)] = twin
        return twin

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name}"


def gguf_embedding(gguf_path: str | Path, name: str = TOKEN_EMBEDDING,
                   table: dict[str, GGUFTensor] | None = None) -> GGUFEmbedding:
    """The 2-D tensor ``name`` of the GGUF file at ``gguf_path`` as a :class:`GGUFEmbedding`.
    ``table``: the file's :func:`~engine.backends.gguf_file.tensor_table` when the caller has it.

    The blocks are read out of the file into memory of their own (131 MB for the embedded
    target's Q4_K embedding) and the file is closed: the module keeps no map of it."""
    path = Path(gguf_path)
    tensor = _find(path, name, table)
    if len(tensor.dims) != 2:
        raise ValueError(f"{path.name}: {name} is not a matrix (dimensions {list(tensor.dims)})")
    return GGUFEmbedding(read_blocks(path, tensor), tensor.qtype, tensor.dims[0])


def tensor_location(path: str | Path, name: str) -> tuple[GGMLQuantizationType, tuple[int, ...], int]:
    """``(type, dimensions innermost first, absolute byte offset)`` of tensor ``name`` in a GGUF
    file, read from the header alone (:func:`engine.backends.gguf_file.tensor_table`)."""
    tensor = _find(Path(path), name)
    return tensor.qtype, tensor.dims, tensor.offset


def _find(path: Path, name: str, table: dict[str, GGUFTensor] | None = None) -> GGUFTensor:
    tensor = (tensor_table(path) if table is None else table).get(name)
    if tensor is None:
        raise ValueError(f"{path.name} has no tensor {name!r}")
    return tensor
