"""Deployments: launching P and D engines with their sidecars and a router (`kvbaton serve`),
and the built-in demo on the tiny model (`kvbaton demo`). The router itself (`router/`) launches
nothing and imports no model."""
