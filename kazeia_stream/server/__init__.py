"""Speech servers on one `Runtime`: OpenAI-compatible HTTP with a conversational WebSocket
(`app`), and Wyoming for Home Assistant (`wyoming`)."""
