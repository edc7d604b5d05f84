"""The Sequoia Chat web app: a Gradio UI around one engine worker.

- ``app.ui``: the layout; ``build_demo(worker, tokenizer, options)`` returns the ``gr.Blocks`` app;
- ``app.handlers``: :class:`ChatApp`, the event handlers the layout wires to its components;
- ``app.text``: the text and HTML the UI shows (pure functions);
- ``app.figures``: pure functions from engine step records to plotly figures and stats lines;
- ``app.conversation``: the chat's messages, context fitting, import and export;
- ``app.worker``: the background thread that owns the models and serves requests in order;
- ``app.openai_api``: ``/v1/chat/completions`` and ``/v1/models`` on the same worker;
- ``app.pair``: a tiny random pair (real tokenizer) for trying the UI without the weights;
- ``app.gradio_stubs``: imports Gradio without the type-stub writer it runs at every import.
"""
from app.gradio_stubs import skip_stub_writer

skip_stub_writer()  # before any app module imports gradio: its import skips rewriting type stubs
