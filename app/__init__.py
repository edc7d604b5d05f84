"""The Sequoia Chat web app: a Gradio UI around one engine worker, by concern.

- :mod:`app.page`: the page's layout, the handlers of its events, what its controls mean (read once
  into a :class:`~engine.core.settings.DecodeSettings`), one answer streamed, the teaching tabs;
- :mod:`app.views`: pure functions from step records and plain values to figures, SVG, HTML, text;
- :mod:`app.serving`: the worker thread that owns the models, the jobs it serves, the pairs it may load;
- :mod:`app.api`: the OpenAI-compatible ``/v1`` routes;
- :mod:`app.web`: the server's guards (Host, Origin, body and connection limits, private events).
"""
from app.page.gradio_stubs import skip_stub_writer

skip_stub_writer()  # before any app module imports gradio: its import skips rewriting type stubs
