"""What every route passes first: the API key, body and time limits, disconnects, validation errors."""
