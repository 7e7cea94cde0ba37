"""The text that calibration passes run a model on (kv_cache_dtype's int8 scales): written for this purpose,
kept apart from the texts quality is measured on, and mixed on purpose (prose, a dialogue, a list, numbers,
code), as the ranges of keys and values differ with what a prompt holds."""

from __future__ import annotations

from typing import Protocol

CALIBRATION_TEXT = """\
The harbour town woke slowly that spring. Fishing boats came back before dawn, their decks stacked with crates,
and by seven the market hall was loud with prices called across the stalls. Nobody remembered who had first
painted the lighthouse red, but every child in the town could tell you how many steps it had: two hundred and
twelve, counting the broken one near the top.

"Are you sure the ferry leaves at nine?" Mara asked, folding the timetable into her coat pocket.
"It leaves when the captain finishes his coffee," her brother said. "Some days that is nine. Some days it is ten."
She laughed, although she had a train to catch on the other side of the bay, and the last one left at 4:45 pm.

A short guide to preparing for a long walk:
1. Check the weather the evening before and again in the morning.
2. Pack water (at least 1.5 litres), a map, a charged phone and a light jacket.
3. Tell someone which route you are taking and when you expect to be back.
4. Start early; the light changes quickly in the hills after 5 o'clock.

In 2023 the regional council counted 48,310 residents, up 3.2% from the census before. The budget for road
repairs rose from 1.8 million to 2.4 million, while spending on the library fell by about 7 percent. Critics
argued that the new bypass would move traffic, not reduce it; supporters replied that the old high street had
carried 14,000 vehicles a day through a lane built for carts.

def moving_average(values, window):
    \"\"\"Return the mean of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages

Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. The light reactions take place in the
thylakoid membranes, where chlorophyll absorbs mostly red and blue light and reflects green; the Calvin cycle,
in the stroma, fixes carbon into three-carbon molecules that the plant builds into glucose, starch and cellulose.

Dear Mr. Okafor, thank you for your letter of 12 March. I am sorry to hear that the parcel arrived damaged. We have
arranged a replacement, which should reach you within five working days, and a courier will collect the broken
item at a time that suits you. Please reply to this message with a convenient date. Kind regards, the support team.

Q: What is the capital of Australia?
A: Canberra, although Sydney and Melbourne are both larger cities.
Q: Why was Canberra chosen?
A: It was a compromise between the two rivals, built on a site roughly between them and planned from scratch.
"""


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def calibration_ids(tokenizer: Encoder, tokens: int = 512) -> list[int]:
    """The calibration text's first `tokens` token ids (with the tokenizer's special tokens, as a prompt has)."""
    return tokenizer.encode(CALIBRATION_TEXT)[:tokens]
