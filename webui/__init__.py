"""The Gradio web UI (ui.py and its tabs). The request flow it shares with the API lives in
serving/; nothing under serving/, loader/, engine/ or kernels/ imports this package."""
