"""The page: its layout (ui), the handlers of its events, what the controls mean, one answer streamed, the teaching tabs."""
