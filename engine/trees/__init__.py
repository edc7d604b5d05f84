"""Token trees (:mod:`.tree`) and Sequoia's dynamic program over them (:mod:`.dp`): pure, no models."""
