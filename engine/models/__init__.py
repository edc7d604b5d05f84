"""What the engine runs on: loading the embedded pair or any Hugging Face pair (:mod:`.loading`),
the bundled prompt set (:mod:`.prompts`) and random-weight models of real shapes
(:mod:`.synthetic`)."""
