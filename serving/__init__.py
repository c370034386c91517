"""The request flow that the web UI (webui/) and the API (extensions/openai) share.

It talks to models only through loader/ (`LoadedModel`) and imports nothing from the front
ends or gradio:

    text_generation.py  prompt -> extension hooks -> the model's stream -> the reply; chat
                        prompts from the model's template; per-request stop
    prompt_fit.py       a chat or text fitted into the context window (TGW's truncation)
    extensions.py       TGW's script.py contract: load, params, setup, hooks in order
    tgw_compat/         TGW's `modules.*` names, so TGW extensions run unchanged
    shared.py           process state: the current model (loader/manager.py), args, settings
    sessions.py         saved chats and remembered settings (storage.py: atomic writes)
    ports.py            is a port free? (ui.py and the API entry ask before loading)
"""
