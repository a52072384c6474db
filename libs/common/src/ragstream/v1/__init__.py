"""Code generated from proto/ragstream/v1 by ``make proto`` (messages, gRPC stubs, typed stubs): do not edit."""
