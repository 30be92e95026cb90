"""Sample services for the spanprof demo."""
