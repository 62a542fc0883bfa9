"""The nsbox command line: every click command, and nothing else imports click."""
