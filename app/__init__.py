"""The Sequoia Chat web app: a Gradio UI around one engine worker.

- ``app.ui``: the layout; ``build_demo(worker, tokenizer, options)`` returns the ``gr.Blocks`` app;
- ``app.handlers``: :class:`ChatApp`, the event handlers the layout wires to its components;
- ``app.answer_stream``: one answer's events turned into the chat's updates, a run's views;
- ``app.controls``: what the controls mean: defaults, clamped values, the tree they name;
- ``app.explain_view``: the three teaching tabs under the chat;
- ``app.text``: the text and HTML the UI shows (pure functions);
- ``app.figures``: pure functions from engine step records to the per-step chart, stats lines and
  the Compare race; ``app.tree_figures``: the token tree of a step (plotly figure and live SVG);
- ``app.conversation``: the chat's messages, context fitting, import and export;
- ``app.worker``: the background thread that owns the models and serves requests in order;
- ``app.jobs``: what the worker is asked (requests), and the jobs and events it answers with;
- ``app.openai_api``: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` on the same
  worker; ``app.openai_requests``: their request bodies checked and turned into calls;
- ``app.pair``: which models may load and how a pair becomes an engine; a tiny random pair (real
  tokenizer) for trying the UI without the weights;
- ``app.gradio_stubs``: imports Gradio without the type-stub writer it runs at every import.
"""
from app.gradio_stubs import skip_stub_writer

skip_stub_writer()  # before any app module imports gradio: its import skips rewriting type stubs
