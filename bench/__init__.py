"""The benchmarks, apart from the library and the app: decode speed against llama.cpp
(``python -m bench.decode``), prefill, tree sizes, multi-turn, GPU, a busy neighbour, the speed on
screen in Chromium (``python -m bench.ui``), and llama.cpp itself run on the same GGUF files
(:mod:`bench.peer`). Each writes its JSON, logs and plots to ``results/``."""
