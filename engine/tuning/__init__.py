"""What the hardware-aware optimizer measures and decides: calibrated acceptance vectors
(:mod:`.calibrate`, :mod:`.acceptance`), the hardware profile (:mod:`.profile`), the choice of
tree (:mod:`.optimizer`) and the cache of solved trees (:mod:`.tree_store`), and replays that
measure trees without decoding (:mod:`.replay`, :mod:`.sampled_replay`)."""
