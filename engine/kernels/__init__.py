"""The compiled CPU kernels, at the bottom of the library: their C++ sources (``csrc/``: the
k-quant layers, attention and lean forward in ``kquant.cpp``, sampling's softmax, nucleus, draw and
ranking in ``nucleus.cpp``, the shared exponential in ``fixed_exp.h``), their building and loading as
one torch extension into the user cache, the ``-march`` path it is built for, and the digest a
timing of them is stamped with (:mod:`.build`); what the CPU advertises (:mod:`.cpu`).

Imports nothing from the engine but :mod:`engine.errors` and :mod:`engine.user_cache`, so every
layer that runs the kernels (the core's sampling, the backends' layers) takes them from here."""
