"""The torch-free floor: facts of the model and its files that every layer above reads, importing nothing of the
package but ``facts/`` itself (no torch, no config). Nothing is imported here."""
