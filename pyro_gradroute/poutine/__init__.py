"""Effect handlers that mark sites for gradient routing."""
