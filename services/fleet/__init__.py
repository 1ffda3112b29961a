"""The fleet controller: a declared fleet (spec), the loop that heals, rolls out and scales it
(controller), and the provisioners that start and stop replica groups (local, kubernetes)."""
