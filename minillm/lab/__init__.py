"""The book's instruments: what the chapters compute and measure with. Models of mechanisms
live here and say so; nothing of the serving path imports this package."""
