"""Test helpers: a tiny offline model and real vLLM server management."""
