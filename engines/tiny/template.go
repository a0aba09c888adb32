package tiny

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/slimen/slimen/engines"
)

// QwenChatTemplate is the Jinja chat template of tiny models with a BPE vocabulary, stored in
// tokenizer_config.json: Qwen3's chat format. Each message is `<|im_start|>role\ncontent<|im_end|>\n`;
// with tools, the system turn (the system message's content, if the first message is one, and a
// blank line) carries a `# Tools` section listing one JSON schema a line inside <tools></tools>
// and the instructions for <tool_call> blocks; consecutive tool messages make one user turn of
// <tool_response> blocks; the generation prompt is `<|im_start|>assistant\n`. An assistant
// message's tool_calls (the OpenAI form) are rendered as Qwen3 renders them,
// `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>` on lines after the content; in slimen an
// assistant message carries its calls as that text in its content (engines/toolcalls.go), which
// renders the same.
//
// Unlike Qwen3's template it never writes a <think> block: Qwen3 with enable_thinking=False puts
// an empty `<think>\n\n</think>\n\n` after the generation prompt and before the last assistant
// message's content, but drops think blocks from earlier turns, so the rendering of a
// conversation is not a prefix of the rendering of its continuation, and every turn would spend
// four tokens on nothing. These models are trained by slimen from scratch and never think
// aloud, and a multi-turn sample must be the same tokens the model generated turn by turn.
// Otherwise the output equals Qwen3's for the same messages and tools.
const QwenChatTemplate = `{%- if tools -%}` +
	`{{- '<|im_start|>system\n' -}}` +
	`{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\n\n' -}}{%- endif -%}` +
	`{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function ` +
	`signatures within <tools></tools> XML tags:\n<tools>' -}}` +
	`{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}` +
	`{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ` +
	`<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": ` +
	`<args-json-object>}\n</tool_call><|im_end|>\n' -}}` +
	`{%- elif messages and messages[0]['role'] == 'system' -%}` +
	`{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' -}}` +
	`{%- endif -%}` +
	`{%- for m in messages -%}` +
	`{%- if m['role'] == 'tool' -%}` +
	`{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}` +
	`{{- '\n<tool_response>\n' + m['content'] + '\n</tool_response>' -}}` +
	`{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}` +
	`{%- elif m['role'] == 'assistant' -%}` +
	`{{- '<|im_start|>assistant\n' + (m['content'] or '') -}}` +
	`{%- for call in (m['tool_calls'] or []) -%}` +
	`{%- if not loop.first or m['content'] -%}{{- '\n' -}}{%- endif -%}` +
	`{%- set f = call['function'] if call['function'] is defined else call -%}` +
	`{{- '<tool_call>\n{"name": "' + f['name'] + '", "arguments": ' + (f['arguments'] if f['arguments'] is string else ` +
	`(f['arguments'] | tojson)) + '}\n</tool_call>' -}}` +
	`{%- endfor -%}` +
	`{{- '<|im_end|>\n' -}}` +
	`{%- elif not (loop.first and m['role'] == 'system') -%}` +
	`{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}` +
	`{%- endif -%}` +
	`{%- endfor -%}` +
	`{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}`

// The text of the system turn's tools section around the schemas.
const (
	qwenToolsHead = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" +
		"You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
	qwenToolsTail = "\n</tools>\n\nFor each function call, return a json object with function name and arguments within " +
		"<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
)

// EncodeChatTools is EncodeChat with tool schemas (JSON, one object each) for the template's
// tools variable. Only the BPE vocabulary's template has one; the character vocabulary refuses
// tools.
func (t *Tokenizer) EncodeChatTools(msgs []engines.Message, tools []string, addGenerationPrompt bool) ([]int32, error) {
	if t.bpe == nil {
		if len(tools) > 0 {
			return nil, fmt.Errorf("the character vocabulary's chat template has no tools variable; describe the tools in a system message")
		}
		return t.EncodeChat(msgs, addGenerationPrompt), nil
	}
	return t.encodeQwenChat(msgs, tools, addGenerationPrompt)
}

// chatIDs accumulates a rendering: the template's own text, in which added tokens are tokens,
// and messages' content, in which the special ones (<|endoftext|>, <|im_start|>, <|im_end|>)
// are plain text, so a message cannot forge a turn, while the plain added tags (<tool_call>,
// <tool_response>, <think> and their ends) are the tokens the model writes for them, as the
// PyTorch worker and Qwen's tokenizers treat them. Text between two tokens is encoded as one
// piece, as the tokenizers library encodes the rendered string.
type chatIDs struct {
	t       *Tokenizer
	ids     []int32
	pending strings.Builder
}

func (c *chatIDs) flush() {
	if c.pending.Len() > 0 {
		c.ids = append(c.ids, c.t.encodeBPE(c.pending.String(), false)...)
		c.pending.Reset()
	}
}

// template appends template text: added tokens in it are tokens.
func (c *chatIDs) template(s string) {
	for len(s) > 0 {
		i := strings.IndexByte(s, '<')
		if i < 0 {
			break
		}
		if m := c.t.matchSpecial(s[i:]); m >= 0 {
			c.pending.WriteString(s[:i])
			c.flush()
			c.ids = append(c.ids, m)
			s = s[i+len(c.t.pieces[m]):]
			continue
		}
		c.pending.WriteString(s[:i+1])
		s = s[i+1:]
	}
	c.pending.WriteString(s)
}

// content appends a message's text (or a tool schema): the plain added tags in it are tokens,
// the rest is text.
func (c *chatIDs) content(s string) {
	for i := 0; i < len(s); i++ {
		if s[i] != '<' {
			continue
		}
		for _, tag := range ChatSpecials[bpeSpecialCount:] {
			if strings.HasPrefix(s[i:], tag) {
				c.pending.WriteString(s[:i])
				c.flush()
				c.ids = append(c.ids, c.t.ids[tag])
				s, i = s[i+len(tag):], -1
				break
			}
		}
	}
	c.pending.WriteString(s)
}

// encodeQwenChat renders messages and tools as QwenChatTemplate does, as token ids.
func (t *Tokenizer) encodeQwenChat(msgs []engines.Message, tools []string, gen bool) ([]int32, error) {
	c := &chatIDs{t: t}
	system := len(msgs) > 0 && msgs[0].Role == "system"
	if len(tools) > 0 {
		c.template("<|im_start|>system\n")
		if system {
			c.content(msgs[0].Content)
			c.template("\n\n")
		}
		c.template(qwenToolsHead)
		for i, tool := range tools {
			js, err := pythonJSON(tool)
			if err != nil {
				return nil, fmt.Errorf("tools[%d]: %w", i, err)
			}
			c.template("\n")
			c.content(js)
		}
		c.template(qwenToolsTail)
	} else if system {
		c.template("<|im_start|>system\n")
		c.content(msgs[0].Content)
		c.template("<|im_end|>\n")
	}
	for i, m := range msgs {
		switch {
		case m.Role == "tool":
			if i == 0 || msgs[i-1].Role != "tool" {
				c.template("<|im_start|>user")
			}
			c.template("\n<tool_response>\n")
			c.content(m.Content)
			c.template("\n</tool_response>")
			if i == len(msgs)-1 || msgs[i+1].Role != "tool" {
				c.template("<|im_end|>\n")
			}
		case m.Role == "assistant":
			c.template("<|im_start|>assistant\n")
			c.content(m.Content)
			c.template("<|im_end|>\n")
		case i == 0 && system:
		default:
			c.template("<|im_start|>")
			c.content(m.Role)
			c.template("\n")
			c.content(m.Content)
			c.template("<|im_end|>\n")
		}
	}
	if gen {
		c.template("<|im_start|>assistant\n")
	}
	c.flush()
	return c.ids, nil
}

// pythonJSON rewrites a JSON text as transformers' tojson filter writes the parsed value (Python's
// json.dumps with ensure_ascii=False): ", " and ": " separators, keys in their order, non-ASCII
// characters as they are, floats as Python's repr writes them.
func pythonJSON(s string) (string, error) {
	dec := json.NewDecoder(strings.NewReader(s))
	dec.UseNumber()
	var b strings.Builder
	if err := writePythonJSON(&b, dec); err != nil {
		return "", fmt.Errorf("not valid JSON: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return "", fmt.Errorf("not valid JSON: text after the value")
	}
	return b.String(), nil
}

func writePythonJSON(b *strings.Builder, dec *json.Decoder) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	switch v := tok.(type) {
	case json.Delim:
		closing := json.Delim(']')
		if v == '{' {
			closing = '}'
		}
		b.WriteRune(rune(v))
		for first := true; dec.More(); first = false {
			if !first {
				b.WriteString(", ")
			}
			if v == '{' {
				k, err := dec.Token()
				if err != nil {
					return err
				}
				writePythonString(b, k.(string))
				b.WriteString(": ")
			}
			if err := writePythonJSON(b, dec); err != nil {
				return err
			}
		}
		if _, err := dec.Token(); err != nil {
			return err
		}
		b.WriteRune(rune(closing))
	case string:
		writePythonString(b, v)
	case json.Number:
		b.WriteString(pythonNumber(v.String()))
	case bool:
		b.WriteString(strconv.FormatBool(v))
	case nil:
		b.WriteString("null")
	}
	return nil
}

// pythonNumber writes a JSON number as Python prints what json.loads makes of it: integers as
// they are (but -0 as 0), other numbers as float reprs (1.0, 1e-05, 1e+16).
func pythonNumber(lit string) string {
	if !strings.ContainsAny(lit, ".eE") {
		if lit == "-0" {
			return "0"
		}
		return lit
	}
	f, err := strconv.ParseFloat(lit, 64)
	if err != nil {
		return lit
	}
	e := strconv.FormatFloat(f, 'e', -1, 64)
	exp, _ := strconv.Atoi(e[strings.IndexByte(e, 'e')+1:])
	if exp < -4 || exp >= 16 {
		return e
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.Contains(s, ".") {
		s += ".0"
	}
	return s
}

// writePythonString writes s as json.dumps(ensure_ascii=False) does.
func writePythonString(b *strings.Builder, s string) {
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		default:
			if r < 0x20 {
				fmt.Fprintf(b, `\u%04x`, r)
			} else {
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
}

// byteTokenizer is a BPE vocabulary without merges: QwenChatText renders with it and decodes.
var byteTokenizer = func() *Tokenizer {
	vocab := make([]string, 256)
	for b := range vocab {
		vocab[b] = string(byteChars[b])
	}
	t, err := newBPETokenizer(vocab, nil, ChatSpecials)
	if err != nil {
		panic(err) // the bytes and the chat specials are a well-formed vocabulary
	}
	return t
}()

// QwenChatText renders messages and tools with QwenChatTemplate as text: what apply_chat_template
// returns with tokenize=False. The text to train a BPE vocabulary on (TrainBPE) for a chat corpus.
func QwenChatText(msgs []engines.Message, tools []string, addGenerationPrompt bool) (string, error) {
	ids, err := byteTokenizer.encodeQwenChat(msgs, tools, addGenerationPrompt)
	if err != nil {
		return "", err
	}
	return byteTokenizer.Decode(ids), nil
}
