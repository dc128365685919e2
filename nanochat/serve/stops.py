"""A completion's text as its tokens come: stop strings found in one pass (StopMatcher) and the text cut before
them or the model's end token (Choice)."""


from nanochat.model.engine import ends_mid_character


class StopMatcher:
    """Finds stop strings in text fed to it piece by piece, each character looked at once per stop (Knuth-Morris-
    Pratt): rescanning the text, or every prefix of a stop, per token costs the square of a long stop string."""

    def __init__(self, stops):
        self.stops, self.tables, self.states, self.fed = stops, None, [0] * len(stops), 0

    def feed(self, text):
        """Read text[self.fed:] (text grows by appending); returns where the earliest stop string found in it starts,
        or None."""
        if self.tables is None:  # built on first use, in the worker thread: a 1 MB stop takes a fraction of a second
            self.tables = [failure_table(stop) for stop in self.stops]
        found = None
        for j, (stop, table) in enumerate(zip(self.stops, self.tables)):
            k = self.states[j]
            for i in range(self.fed, len(text)):
                c = text[i]
                while k and stop[k] != c:
                    k = table[k - 1]
                if stop[k] == c:
                    k += 1
                if k == len(stop):
                    found = i + 1 - k if found is None else min(found, i + 1 - k)
                    break  # this stop's first occurrence: a later one cannot start earlier
            self.states[j] = k
        self.fed = len(text)
        return found

    def partial(self):
        """Length of the longest end of the fed text that begins a stop string: held back until it is known not to
        be one."""
        return max(self.states, default=0)


def failure_table(stop):
    """table[i]: the length of the longest proper prefix of stop[:i+1] that is also its suffix (KMP)."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[k] != stop[i]:
            k = table[k - 1]
        if stop[k] == stop[i]:
            k += 1
        table[i] = k
    return table


class Choice:
    """One completion's text as its tokens come, cut before the first stop string or the model's end token."""

    def __init__(self, tokenizer, stops, end_tokens=()):
        self.tokenizer, self.stops, self.end_tokens = tokenizer, stops, end_tokens
        self.tokens, self.text, self.finish_reason = [], "", None  # text: what has been handed out
        self.end_token = None  # the end token the model chose, if it chose one: not text, but scored
        self.matcher = StopMatcher(stops)

    def add(self, token, last):
        """The next token; returns the text that became final."""
        if token in self.end_tokens:
            self.end_token = token
        else:
            self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        # characters before a trailing U+FFFD are final; the U+FFFD may yet become a character split across tokens
        cut = self.matcher.feed(text if last or self.end_token is not None else text.rstrip("\ufffd"))
        if cut is not None or self.end_token is not None:
            return self.finish("stop", text[:cut])
        if last:
            return self.finish("length", text)
        if ends_mid_character(text):  # wait for the rest of the character
            return ""
        return self.finish(None, text[:len(text) - self.matcher.partial()])

    def finish(self, reason, text):
        piece, self.text, self.finish_reason = text[len(self.text):], text, reason
        return piece
