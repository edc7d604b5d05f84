"""The Sequoia Chat web app: a Gradio UI around one engine worker.

- ``app.figures``: pure functions from engine step records to plotly figures and stats lines;
- ``app.worker``: the background thread that owns the models and serves requests in order;
- ``app.ui``: ``build_demo(worker, tokenizer, options)`` returns the ``gr.Blocks`` app.
"""
