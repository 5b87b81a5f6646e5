"""The server side: scheduler, radix cache, model runner. Only protocol.py and client.py are torch-free."""
