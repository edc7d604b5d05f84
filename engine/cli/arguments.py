"""Options shared by the command lines (``engine.cli.*`` and ``launch.py``)."""
from __future__ import annotations

import argparse


def formats_of(args: argparse.Namespace):
    """The :class:`engine.models.loading.PairFormats` the format options name."""
    from engine.models.loading import PairFormats

    return PairFormats(args.target_format, args.draft_format, args.draft_vocab, args.dequantise_unserved)


def add_format_arguments(parser: argparse.ArgumentParser) -> None:
    """``--draft-format``, ``--target-format`` (how each model's weights are stored on CPU), ``--draft-vocab``
    and ``--dequantise-unserved``."""
    from engine.backends.quantize import DRAFT_FORMATS, TARGET_FORMATS

    parser.add_argument("--target-format", choices=TARGET_FORMATS, default="auto",
                        help="target weights: int4 (the GGUF's own blocks, whatever their type, on "
                             "batch-invariant kernels, exact; engine/backends/kquant.py) or float32 (the dequantised "
                             "values); auto = int4 on the CPU, float32 on a GPU")

    parser.add_argument("--draft-format", choices=DRAFT_FORMATS, default="auto",
                        help="draft weights: int4, int8, q4k (the target's k-quant kernels) or none (float); auto takes the fastest that keeps "
                             "acceptance on this CPU (see engine/backends/quantize.py)")
    parser.add_argument("--draft-vocab", default="auto", metavar="auto|0|N",
                        help="token ids the draft's head computes (a k-quant draft): 0 all, N the first N, auto the "
                             "embedded draft's first 32,768 and every ASCII token (all for other drafts); outputs "
                             "stay exact, the draft gets cheaper (engine/backends/draft_vocabulary.py)")
    parser.add_argument("--dequantise-unserved", action="store_true",
                        help="run a GGUF block type without a kernel (IQ*, TQ*, ...) dequantised to float32 instead "
                             "of refusing the file (the model card line says so)")
