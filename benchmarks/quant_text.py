"""The fixed texts `pdserve bench quant` scores: a passage for perplexity and chat prompts for greedy
agreement. Written for pdserve; changing them changes every recorded number."""

PASSAGE = """\
The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only people who \
saw it up close were the keeper and the men who brought his supplies. Every evening at sunset the keeper \
climbed the one hundred and twelve steps to the lamp room, trimmed the wick, polished the great glass lens \
and lit the flame. Through the night he wound the clockwork that turned the lens, so that the beam swept \
across the water once every ten seconds. Sailors far out at sea counted the flashes to know which \
lighthouse they were looking at, because every light on the coast had its own rhythm.

In the nineteenth century the work changed slowly. Oil lamps gave way to paraffin, and paraffin gave way \
to electricity. The clockwork was replaced by an electric motor, and the keeper no longer had to climb the \
stairs in the middle of the night. By the end of the twentieth century most lighthouses were automatic: a \
sensor switched the lamp on when the light faded, and a technician visited a few times a year to check the \
batteries and clean the glass.

Many people still visit lighthouses today, not because ships need them as much as they once did, but \
because they remind us of a time when a single person, working alone through long winter nights, kept \
strangers safe. Some towers have become museums, where visitors can see the old lenses and read the \
logbooks that keepers filled with notes about the weather, the ships that passed, and the birds that \
struck the glass during storms. Others have been turned into small hotels, and a few are still looked \
after by volunteers who raise money to paint the walls and repair the roofs.

Modern ships find their way with satellite navigation, radar and electronic charts. Yet sailors will tell \
you that when the screens go dark, a light on the horizon is still the most welcome sight in the world. \
Water, wind and rock have not changed, and neither has the simple idea behind the tower: put a bright \
light in a high place, and make sure it never goes out.
"""

PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about autumn leaves.",
    "Give me three tips for learning a new language.",
    "What is 17 multiplied by 3?",
    "Describe how a bicycle works.",
    "Name four planets of the solar system.",
    "Why do cats purr?",
    "Write a Python function that reverses a string.",
    "What should I pack for a weekend hiking trip?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How do vaccines train the immune system?",
    "Suggest a name for a bakery that sells only bread.",
    "What are the benefits of drinking water?",
    "Translate 'good morning' into Spanish and German.",
    "Explain what a prime number is to a child.",
]
