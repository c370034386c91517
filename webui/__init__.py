"""The web front ends: the Gradio UI (ui.py and its tabs), the extension machinery, and the
state they share. Nothing under engine/, kernels/ or loader/ imports this package."""
