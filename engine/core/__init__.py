"""The decoding core: one draft-verify step (:mod:`.speculative`), the acceptance rules
(:mod:`.verify`), sampling (:mod:`.sampling`), model runners and KV caches (:mod:`.runner`,
:mod:`.kv_cache`, :mod:`.prefix_cache`), and the records it emits."""
