"""The model side: one Ray Serve deployment per served model, owning a continuous-batching engine.

Speaks token ids only; text, chat templates and OpenAI JSON live in serve_app/."""
