"""Conversation data: loading (JSONL in OpenAI or ShareGPT shape, the embedded ShareGPT package), rendering with
the target's chat template, and loss masks on assistant tokens."""
