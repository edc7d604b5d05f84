"""The server's guards: Host and Origin checks, body and connection limits, private events."""
