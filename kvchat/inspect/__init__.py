"""`kvchat inspect` without torch: a prompt explained against a saved snapshot (`explain`)."""
