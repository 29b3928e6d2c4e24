"""Training code for the small trained DeepSeek V4 model (issue 36); not shipped with the service."""
