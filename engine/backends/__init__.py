"""CPU and CUDA machinery under the models: the int4 target's k-quant layers (:mod:`.kquant`, on
the compiled kernels of :mod:`engine.kernels`), whole models of them (:mod:`.kquant_model`) and
their one-loop forward (:mod:`.lean`),
oneDNN-packed float layers (:mod:`.kernels`), the int4/int8 draft (:mod:`.quantize`), memory that
does not double at load (:mod:`.mapped`, :mod:`.hugepages`), token embeddings kept in their GGUF
blocks (:mod:`.gguf_embedding`) and GPU offloading (:mod:`.offload`)."""
