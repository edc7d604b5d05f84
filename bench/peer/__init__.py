"""llama.cpp as a benchmark peer: built by ``make peer`` (``build.sh``), run on the same GGUF files
and prompt ids (:mod:`.llama_cpp`)."""
