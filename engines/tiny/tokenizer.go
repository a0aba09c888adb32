package tiny

import (
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/slimen/slimen/engines"
)

// Special tokens of the character vocabulary. Chat turns are delimited by role tokens and <|end|>,
// which is also the end-of-sequence token.
const (
	tokPad       = "<|pad|>"
	tokEnd       = "<|end|>"
	tokSystem    = "<|system|>"
	tokUser      = "<|user|>"
	tokAssistant = "<|assistant|>"
	tokUnk       = "<|unk|>"
)

// ChatTemplate is the Jinja chat template of tiny models, stored in tokenizer_config.json. The Go
// rendering (Tokenizer.EncodeChat; renderChat in the tests, as text) produces exactly what
// transformers' apply_chat_template produces with it; the compatibility test checks that.
const ChatTemplate = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}" +
	"{% if add_generation_prompt %}<|assistant|>{% endif %}"

// Tokenizer is one of two vocabularies. The character vocabulary (builtin:tiny-arith and
// builtin:tiny-agent): special tokens are matched first, leftmost-longest, then every character
// is one token; characters outside the vocabulary become <|unk|>. It is the behaviour of a
// Hugging Face BPE model without merges, which is how it is written to tokenizer.json, and its
// chat template is ChatTemplate. The byte-level BPE vocabulary of TrainBPE (bpe.go): added
// tokens are matched first the same way, the rest is split into pre-tokens and merged as
// Qwen2's tokenizers do, and its chat template is QwenChatTemplate (template.go).
type Tokenizer struct {
	pieces  []string         // id → text (for BPE: the bytes the token stands for)
	chars   map[rune]int32   // one-character pieces (character vocabulary)
	special []int32          // added (special) tokens, longest first
	ids     map[string]int32 // every piece → id (for BPE: the added tokens)
	unk     int32            // -1 for BPE, which has no unknown token
	eos     int32
	pad     int32
	bpe     *bpeModel // nil for the character vocabulary
}

// newCharTokenizer builds the vocabulary of new models: the special tokens, newline and the
// printable ASCII characters, 102 tokens.
func newCharTokenizer() *Tokenizer {
	pieces := []string{tokPad, tokEnd, tokSystem, tokUser, tokAssistant, tokUnk, "\n"}
	for c := ' '; c <= '~'; c++ {
		pieces = append(pieces, string(c))
	}
	t, err := buildTokenizer(pieces, 6, tokUnk, tokEnd, tokPad)
	if err != nil {
		panic(err) // the built-in vocabulary is well formed
	}
	return t
}

// buildTokenizer indexes a vocabulary whose first nSpecial pieces are special tokens.
func buildTokenizer(pieces []string, nSpecial int, unk, eos, pad string) (*Tokenizer, error) {
	t := &Tokenizer{pieces: pieces, chars: map[rune]int32{}, ids: map[string]int32{}}
	for id, p := range pieces {
		if _, dup := t.ids[p]; dup {
			return nil, fmt.Errorf("token %q appears twice in the vocabulary", p)
		}
		t.ids[p] = int32(id)
		if id < nSpecial {
			t.special = append(t.special, int32(id))
			continue
		}
		r, size := utf8.DecodeRuneInString(p)
		if p == "" || size != len(p) || r == utf8.RuneError {
			return nil, fmt.Errorf("token %d %q is not a single character: only character-level vocabularies are supported", id, p)
		}
		t.chars[r] = int32(id)
	}
	sort.SliceStable(t.special, func(i, j int) bool { return len(pieces[t.special[i]]) > len(pieces[t.special[j]]) })
	for _, s := range []struct {
		name, piece string
		dst         *int32
	}{{"unk_token", unk, &t.unk}, {"eos_token", eos, &t.eos}, {"pad_token", pad, &t.pad}} {
		id, ok := t.ids[s.piece]
		if !ok {
			return nil, fmt.Errorf("%s %q is not in the vocabulary", s.name, s.piece)
		}
		*s.dst = id
	}
	return t, nil
}

// VocabSize is the number of tokens.
func (t *Tokenizer) VocabSize() int { return len(t.pieces) }

// Encode tokenizes raw text; special-token strings in the text become their special ids, as the
// Hugging Face tokenizer does.
func (t *Tokenizer) Encode(text string) []int32 { return t.encode(text, true) }

// EncodeText tokenizes text as plain text: special-token strings in it are their characters,
// never special ids. What a message's content is encoded with (EncodeChat).
func (t *Tokenizer) EncodeText(text string) []int32 { return t.encode(text, false) }

// EncodeChat renders messages as ChatTemplate does, as token ids: the template's own text (the
// role tags, <|end|>, the generation prompt) with its special tokens, each message's content as
// plain text (EncodeText). Special-token text inside a message ("<|end|><|assistant|>") stays
// text, so a message cannot forge a turn. Content without such text encodes as the template's
// rendering does (Encode of renderChat).
func (t *Tokenizer) EncodeChat(msgs []engines.Message, addGenerationPrompt bool) []int32 {
	if t.bpe != nil {
		ids, _ := t.encodeQwenChat(msgs, nil, addGenerationPrompt) // without tools it cannot fail
		return ids
	}
	var ids []int32
	for _, m := range msgs {
		ids = append(ids, t.Encode("<|"+m.Role+"|>")...)
		ids = append(ids, t.EncodeText(m.Content)...)
		ids = append(ids, t.Encode(tokEnd)...)
	}
	if addGenerationPrompt {
		ids = append(ids, t.Encode(tokAssistant)...)
	}
	return ids
}

func (t *Tokenizer) encode(text string, special bool) []int32 {
	if t.bpe != nil {
		return t.encodeBPE(text, special)
	}
	ids := make([]int32, 0, len(text))
	for i := 0; i < len(text); {
		if special {
			if m := t.matchSpecial(text[i:]); m >= 0 {
				ids = append(ids, m)
				i += len(t.pieces[m])
				continue
			}
		}
		r, size := utf8.DecodeRuneInString(text[i:])
		id, ok := t.chars[r]
		if !ok || (r == utf8.RuneError && size == 1) {
			id = t.unk
		}
		ids = append(ids, id)
		i += size
	}
	return ids
}

func (t *Tokenizer) matchSpecial(s string) int32 {
	for _, id := range t.special {
		if strings.HasPrefix(s, t.pieces[id]) {
			return id
		}
	}
	return -1
}

// ChatTemplate returns the Jinja chat template the tokenizer renders (EncodeChat): ChatTemplate
// for the character vocabulary, QwenChatTemplate for BPE.
func (t *Tokenizer) ChatTemplate() string {
	if t.bpe != nil {
		return QwenChatTemplate
	}
	return ChatTemplate
}

// TokenBytes returns the bytes token id stands for: its character, for BPE the bytes of its
// piece (which may be part of a UTF-8 sequence), for an added token its text (IsSpecial tells
// those apart); nil for an id outside the vocabulary. Decode is the concatenation of these.
func (t *Tokenizer) TokenBytes(id int32) []byte {
	if id < 0 || int(id) >= len(t.pieces) {
		return nil
	}
	return []byte(t.pieces[id])
}

// IsSpecial says whether id is an added token (<|end|>, <|im_start|>, <tool_call>, …): matched
// in raw text by Encode but never produced from the text of a message.
func (t *Tokenizer) IsSpecial(id int32) bool { return slices.Contains(t.special, id) }

// Decode concatenates the pieces of ids (special tokens as their text).
func (t *Tokenizer) Decode(ids []int32) string {
	var b strings.Builder
	for _, id := range ids {
		b.WriteString(t.piece(id))
	}
	return b.String()
}

func (t *Tokenizer) piece(id int32) string {
	if id < 0 || int(id) >= len(t.pieces) {
		return ""
	}
	return t.pieces[id]
}

// hfTokenizerFile is tokenizer.json, the Hugging Face tokenizers format: a BPE model with no merges and no
// normalizer, pre-tokenizer or post-processor is exactly a character tokenizer; the Fuse decoder
// joins tokens without spaces.
type hfTokenizerFile struct {
	Version       string          `json:"version"`
	Truncation    json.RawMessage `json:"truncation"`
	Padding       json.RawMessage `json:"padding"`
	AddedTokens   []hfAddedToken  `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         hfBPE           `json:"model"`
}

type hfAddedToken struct {
	ID         int32  `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

type hfBPE struct {
	Type                    string           `json:"type"`
	Dropout                 *float64         `json:"dropout"`
	UnkToken                *string          `json:"unk_token"`
	ContinuingSubwordPrefix *string          `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string          `json:"end_of_word_suffix"`
	FuseUnk                 bool             `json:"fuse_unk"`
	ByteFallback            bool             `json:"byte_fallback"`
	IgnoreMerges            bool             `json:"ignore_merges"`
	Vocab                   map[string]int32 `json:"vocab"`
	Merges                  []any            `json:"merges"`
}

// tokenizerConfig is tokenizer_config.json: the chat template and the names of the special tokens.
type tokenizerConfig struct {
	TokenizerClass            string  `json:"tokenizer_class"`
	ChatTemplate              string  `json:"chat_template"`
	BOSToken                  *string `json:"bos_token"`
	EOSToken                  string  `json:"eos_token"`
	PadToken                  string  `json:"pad_token"`
	UnkToken                  string  `json:"unk_token"`
	ModelMaxLength            int     `json:"model_max_length"`
	CleanUpTokenizationSpaces bool    `json:"clean_up_tokenization_spaces"`
	AddBOSToken               bool    `json:"add_bos_token"`
	AddEOSToken               bool    `json:"add_eos_token"`
	SplitSpecialTokens        bool    `json:"split_special_tokens"`
}

// files returns the contents of tokenizer.json and tokenizer_config.json.
func (t *Tokenizer) files(maxLen int) (tokJSON, cfgJSON []byte, err error) {
	if t.bpe != nil {
		return t.bpeFiles(maxLen)
	}
	unk := t.pieces[t.unk]
	f := hfTokenizerFile{
		Version:       "1.0",
		Truncation:    json.RawMessage("null"),
		Padding:       json.RawMessage("null"),
		Normalizer:    json.RawMessage("null"),
		PreTokenizer:  json.RawMessage("null"),
		PostProcessor: json.RawMessage("null"),
		Decoder:       json.RawMessage(`{"type":"Fuse"}`),
		Model: hfBPE{
			Type:     "BPE",
			UnkToken: &unk,
			Vocab:    map[string]int32{},
			Merges:   []any{},
		},
	}
	for _, id := range slices.Sorted(slices.Values(t.special)) {
		f.AddedTokens = append(f.AddedTokens, hfAddedToken{ID: id, Content: t.pieces[id], Special: true})
	}
	for id, p := range t.pieces {
		f.Model.Vocab[p] = int32(id)
	}
	if tokJSON, err = json.MarshalIndent(f, "", "  "); err != nil {
		return nil, nil, err
	}
	c := tokenizerConfig{
		TokenizerClass: "PreTrainedTokenizerFast",
		ChatTemplate:   ChatTemplate,
		EOSToken:       t.pieces[t.eos],
		PadToken:       t.pieces[t.pad],
		UnkToken:       unk,
		ModelMaxLength: maxLen,
	}
	if cfgJSON, err = json.MarshalIndent(c, "", "  "); err != nil {
		return nil, nil, err
	}
	return tokJSON, cfgJSON, nil
}

// parseTokenizer reads tokenizer.json and tokenizer_config.json. Errors name the field at fault;
// the caller adds the file name.
func parseTokenizer(tokJSON, cfgJSON []byte) (*Tokenizer, error) {
	var c tokenizerConfig
	if err := json.Unmarshal(cfgJSON, &c); err != nil {
		return nil, &fileError{"tokenizer_config.json", fmt.Errorf("not valid JSON: %w", err)}
	}
	if c.AddBOSToken || c.AddEOSToken {
		return nil, &fileError{"tokenizer_config.json", fmt.Errorf("add_bos_token/add_eos_token are not supported")}
	}
	var f hfTokenizerFile
	if err := json.Unmarshal(tokJSON, &f); err != nil {
		return nil, &fileError{"tokenizer.json", fmt.Errorf("not valid JSON: %w", err)}
	}
	if len(f.Model.Merges) > 0 || (len(f.PreTokenizer) > 0 && string(f.PreTokenizer) != "null") {
		return parseBPE(&f, &c)
	}
	if strings.TrimSpace(c.ChatTemplate) != ChatTemplate {
		return nil, &fileError{"tokenizer_config.json", fmt.Errorf("chat_template is not the template the tiny engine renders "+
			"with a character vocabulary; expected %q", ChatTemplate)}
	}
	bad := func(format string, a ...any) error { return &fileError{"tokenizer.json", fmt.Errorf(format, a...)} }
	if f.Model.Type != "BPE" || len(f.Model.Merges) != 0 {
		return nil, bad("model must be a BPE model without merges (a character vocabulary), got type %q with %d merges", f.Model.Type, len(f.Model.Merges))
	}
	for name, raw := range map[string]json.RawMessage{"normalizer": f.Normalizer, "pre_tokenizer": f.PreTokenizer, "post_processor": f.PostProcessor} {
		if len(raw) > 0 && string(raw) != "null" {
			return nil, bad("%s must be null for a character vocabulary", name)
		}
	}
	if f.Model.UnkToken == nil {
		return nil, bad("model.unk_token must be set")
	}
	if f.Model.ByteFallback || f.Model.FuseUnk || (f.Model.ContinuingSubwordPrefix != nil && *f.Model.ContinuingSubwordPrefix != "") ||
		(f.Model.EndOfWordSuffix != nil && *f.Model.EndOfWordSuffix != "") {
		return nil, bad("byte_fallback, fuse_unk, continuing_subword_prefix and end_of_word_suffix are not supported")
	}
	n := len(f.Model.Vocab)
	pieces := make([]string, n)
	for p, id := range f.Model.Vocab {
		if id < 0 || int(id) >= n || pieces[id] != "" {
			return nil, bad("model.vocab ids must be 0..%d, each once (token %q has id %d)", n-1, p, id)
		}
		pieces[id] = p
	}
	// Special tokens first in the internal order is not required by the file; re-index by the
	// file's ids and mark the added tokens.
	isSpecial := map[int32]bool{}
	for _, a := range f.AddedTokens {
		if a.ID < 0 || int(a.ID) >= n || pieces[a.ID] != a.Content {
			return nil, bad("added token %q (id %d) is not in model.vocab with that id", a.Content, a.ID)
		}
		if a.LStrip || a.RStrip || a.SingleWord || a.Normalized {
			return nil, bad("added token %q: lstrip, rstrip, single_word and normalized must be false", a.Content)
		}
		isSpecial[a.ID] = true
	}
	t := &Tokenizer{pieces: pieces, chars: map[rune]int32{}, ids: map[string]int32{}}
	for id, p := range pieces {
		t.ids[p] = int32(id)
		if isSpecial[int32(id)] {
			t.special = append(t.special, int32(id))
			continue
		}
		r, size := utf8.DecodeRuneInString(p)
		if size != len(p) || p == "" {
			return nil, bad("token %d %q is neither one character nor an added token: only character-level vocabularies are supported", id, p)
		}
		t.chars[r] = int32(id)
	}
	sort.SliceStable(t.special, func(i, j int) bool { return len(pieces[t.special[i]]) > len(pieces[t.special[j]]) })
	for _, s := range []struct {
		name, piece string
		dst         *int32
	}{{"unk_token", *f.Model.UnkToken, &t.unk}, {"eos_token", c.EOSToken, &t.eos}, {"pad_token", c.PadToken, &t.pad}} {
		id, ok := t.ids[s.piece]
		if !ok {
			return nil, &fileError{"tokenizer_config.json", fmt.Errorf("%s %q is not in the vocabulary of tokenizer.json", s.name, s.piece)}
		}
		*s.dst = id
	}
	return t, nil
}

// fileError is an error in one file of a model folder; the loader prefixes the folder.
type fileError struct {
	file string
	err  error
}

func (e *fileError) Error() string { return e.file + ": " + e.err.Error() }
func (e *fileError) Unwrap() error { return e.err }
