package openai

import (
	"context"
	"strings"
	"unicode/utf8"

	"github.com/slimen/slimen/engines"
)

// Streaming as the engine samples: with an engine that hands over each sample's text as it grows
// (TokenStreamer: the tiny engine), a streamed chat completion, text completion or response sends
// its text in deltas while the engine still samples, not all at the end. What a delta may hold is
// decided by textDeltas: only text the final answer begins with, so the deltas add up to the
// answer a non-streamed request gets. Tool calls go out when the sample ends, each as the API's
// deltas of tool_calls (its id and name, then its arguments).

// TokenStreamer is implemented by engines that report each sample's text as they sample it.
// piece is called on the goroutine that called GenerateStream, before it returns, with the text
// that sample index of request req (its position in reqs) added; a sample's pieces add up to the
// text it sampled, which may run past the stop string that ended it (its Completion's Text is
// cut there).
type TokenStreamer interface {
	GenerateStream(ctx context.Context, reqs []engines.GenerateRequest, piece func(req, index int, text string)) ([]engines.Completion, error)
}

// sampleStreaming samples the completions of one request, handing piece each sample's new text
// as the engine samples it where the engine streams and piece is not nil.
func (h *handler) sampleStreaming(ctx context.Context, g engines.GenerateRequest, piece func(index int, text string)) ([]engines.Completion, error) {
	var each func(req, index int, text string)
	if piece != nil {
		each = func(_, index int, text string) { piece(index, text) }
	}
	return h.generateStreaming(ctx, []engines.GenerateRequest{g}, each)
}

// generateStreaming samples reqs, handing piece each sample's new text as the engine samples it
// where the engine streams and piece is not nil.
func (h *handler) generateStreaming(ctx context.Context, reqs []engines.GenerateRequest,
	piece func(req, index int, text string)) ([]engines.Completion, error) {
	ts, ok := h.eng.(TokenStreamer)
	if !ok || piece == nil {
		return h.eng.Generate(ctx, reqs)
	}
	return ts.GenerateStream(ctx, reqs, piece)
}

// textDeltas is what a stream has sent of one sample's text while it is sampled. It sends only
// text the answer's content will begin with: it holds back text that may still become a stop
// string (the engine cuts the answer there), anything from a tool call's opening tag on (a call
// goes out as tool_calls at the end), while the answer is read for tool calls its leading and
// trailing whitespace (a message with calls has its content trimmed), and a UTF-8 character
// not yet whole.
type textDeltas struct {
	raw    strings.Builder
	sent   int // bytes of raw sent
	stops  []string
	tools  bool // the answer is read for tool calls
	closed bool // a stop string or a tool call began: nothing more is sent before the end
}

func newTextDeltas(stops []string, tools bool) *textDeltas {
	return &textDeltas{stops: stops, tools: tools}
}

// add takes a piece of the sample's text and returns what may be sent now ("": nothing).
func (d *textDeltas) add(piece string) string {
	d.raw.WriteString(piece)
	if d.closed {
		return ""
	}
	raw := d.raw.String()
	marks := d.stops
	if d.tools {
		marks = append(marks[:len(marks):len(marks)], engines.ToolCallOpen)
	}
	end := len(raw)
	for _, m := range marks {
		if m == "" {
			continue
		}
		// A mark begins after what was sent: a prefix of it was always held back.
		if i := strings.Index(raw[d.sent:], m); i >= 0 && d.sent+i < end {
			end, d.closed = d.sent+i, true
		}
	}
	if !d.closed {
		for _, m := range marks {
			for k := min(len(m)-1, len(raw)-d.sent); k > 0; k-- {
				if strings.HasSuffix(raw, m[:k]) {
					end = min(end, len(raw)-k)
					break
				}
			}
		}
	}
	if d.tools {
		for end > d.sent && isSpace(raw[end-1]) {
			end--
		}
		if d.sent == 0 && strings.TrimSpace(raw[:end]) == "" {
			end = 0
		}
	}
	if end > d.sent {
		// A character cut by the piece's end waits for its other bytes.
		i := end - 1
		for i > d.sent && end-i < utf8.UTFMax && !utf8.RuneStart(raw[i]) {
			i--
		}
		if !utf8.FullRuneInString(raw[i:end]) {
			end = i
		}
	}
	if end <= d.sent {
		return ""
	}
	out := raw[d.sent:end]
	d.sent = end
	return out
}

// rest is what is left to send of the answer's content once the sample ended: all of it past
// what was sent, which it begins with (unless whitespace sent before a later tool call was
// trimmed from it: then nothing more).
func (d *textDeltas) rest(content string) string {
	sent := d.raw.String()[:d.sent]
	if !strings.HasPrefix(content, sent) {
		return ""
	}
	return content[len(sent):]
}

func isSpace(b byte) bool {
	return b == ' ' || b == '\n' || b == '\t' || b == '\r'
}
