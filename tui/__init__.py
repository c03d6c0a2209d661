"""The Textual terminal app (installed as `localllm.tui`): Models, Chat, Conversations, Server."""
