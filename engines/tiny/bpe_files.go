package tiny

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
)

// The added tokens of the chat vocabulary, in the order of their ids (after the merges), as
// Qwen3 has them: <|endoftext|> pads, <|im_start|> and <|im_end|> delimit turns (<|im_end|> is
// the end-of-sequence token), the others mark tool calls, tool responses and thinking.
const (
	tokEndOfText    = "<|endoftext|>"
	tokIMStart      = "<|im_start|>"
	tokIMEnd        = "<|im_end|>"
	tokToolCall     = "<tool_call>"
	tokToolCallEnd  = "</tool_call>"
	tokToolResp     = "<tool_response>"
	tokToolRespEnd  = "</tool_response>"
	tokThink        = "<think>"
	tokThinkEnd     = "</think>"
	bpeSpecialCount = 3 // the first three are "special" in tokenizer.json (skipped by decode(skip_special_tokens=True))
)

// ChatSpecials are the added tokens of a BPE chat vocabulary; TrainBPE's specials must hold them all.
var ChatSpecials = []string{tokEndOfText, tokIMStart, tokIMEnd, tokToolCall, tokToolCallEnd, tokToolResp, tokToolRespEnd, tokThink, tokThinkEnd}

// newBPETokenizer indexes a byte-level vocabulary (ids 0..255 the bytes, then the merged tokens),
// its merges by rank, and the added tokens, which take the ids after the vocabulary.
func newBPETokenizer(vocab []string, merges [][2]int32, specials []string) (*Tokenizer, error) {
	m := &bpeModel{vocab: slices.Clone(vocab), merges: merges, rank: make(map[uint64]bpeRes, len(merges))}
	ids := make(map[string]int32, len(vocab))
	for id, p := range vocab {
		if _, dup := ids[p]; dup {
			return nil, fmt.Errorf("token %q appears twice in model.vocab", p)
		}
		ids[p] = int32(id)
	}
	for b := range 256 {
		id, ok := ids[string(byteChars[b])]
		if !ok {
			return nil, fmt.Errorf("model.vocab lacks the token of byte 0x%02x (%q): a byte-level vocabulary has all 256", b, string(byteChars[b]))
		}
		m.byteID[b] = id
	}
	for r, mg := range merges {
		a, b := mg[0], mg[1]
		if a < 0 || b < 0 || int(a) >= len(vocab) || int(b) >= len(vocab) {
			return nil, fmt.Errorf("merge %d joins a token outside model.vocab", r)
		}
		id, ok := ids[vocab[a]+vocab[b]]
		if !ok {
			return nil, fmt.Errorf("merge %d (%q %q) makes %q, which is not in model.vocab", r, vocab[a], vocab[b], vocab[a]+vocab[b])
		}
		if _, dup := m.rank[pairKey(a, b)]; !dup {
			m.rank[pairKey(a, b)] = bpeRes{rank: int32(r), id: id}
		}
	}
	t := &Tokenizer{bpe: m, ids: map[string]int32{}, unk: -1}
	t.pieces = make([]string, len(vocab), len(vocab)+len(specials))
	for id, p := range vocab {
		s, ok := unByteLevel(p)
		if !ok || s == "" {
			return nil, fmt.Errorf("token %d %q of model.vocab is not written in byte-level characters", id, p)
		}
		t.pieces[id] = s
	}
	for _, s := range ChatSpecials {
		if !slices.Contains(specials, s) {
			return nil, fmt.Errorf("the added tokens lack %s, which the chat template needs (%s)", s, strings.Join(ChatSpecials, " "))
		}
	}
	for _, s := range specials {
		if _, dup := t.ids[s]; dup || s == "" {
			return nil, fmt.Errorf("added token %q is empty or repeated", s)
		}
		id := int32(len(t.pieces))
		t.pieces = append(t.pieces, s)
		m.vocab = append(m.vocab, "")
		t.ids[s] = id
		t.special = append(t.special, id)
	}
	sort.SliceStable(t.special, func(i, j int) bool { return len(t.pieces[t.special[i]]) > len(t.pieces[t.special[j]]) })
	t.eos, t.pad = t.ids[tokIMEnd], t.ids[tokEndOfText]
	return t, nil
}

// encodeBPE tokenizes text with the BPE vocabulary: added tokens first when special is set, then
// each pre-token of the text between them.
func (t *Tokenizer) encodeBPE(text string, special bool) []int32 {
	ids := make([]int32, 0, len(text)/3+1)
	word := func(w string) { ids = t.bpe.encodeWord(ids, w) }
	for len(text) > 0 {
		cut, sp := len(text), int32(-1)
		if special {
			for i := 0; i < len(text); i++ {
				if text[i] == '<' {
					if m := t.matchSpecial(text[i:]); m >= 0 {
						cut, sp = i, m
						break
					}
				}
			}
		}
		splitQwen2(text[:cut], word)
		if sp < 0 {
			break
		}
		ids = append(ids, sp)
		text = text[cut+len(t.pieces[sp]):]
	}
	return ids
}

// bpeTokenizerFile is tokenizer.json of a BPE vocabulary, with the fields in the order the
// tokenizers library writes them.
type bpeTokenizerFile struct {
	Version       string          `json:"version"`
	Truncation    json.RawMessage `json:"truncation"`
	Padding       json.RawMessage `json:"padding"`
	AddedTokens   []hfAddedToken  `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         json.RawMessage `json:"model"`
}

// The pre-tokenizer and decoder of a BPE vocabulary's tokenizer.json, as the tokenizers library
// writes them (Split with the Qwen2 pattern, then byte-level characters without the GPT-2 regex).
var (
	bpePreTokenizer = mustCompactJSON(map[string]any{"type": "Sequence", "pretokenizers": []any{
		map[string]any{"type": "Split", "pattern": map[string]any{"Regex": qwen2SplitPattern}, "behavior": "Isolated", "invert": false},
		map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
	}})
	bpeDecoder = mustCompactJSON(map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false})
)

func mustCompactJSON(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// bpeTokenizerConfig is tokenizer_config.json of a BPE vocabulary.
type bpeTokenizerConfig struct {
	TokenizerClass            string  `json:"tokenizer_class"`
	ChatTemplate              string  `json:"chat_template"`
	BOSToken                  *string `json:"bos_token"`
	EOSToken                  string  `json:"eos_token"`
	PadToken                  string  `json:"pad_token"`
	UnkToken                  *string `json:"unk_token"`
	ModelMaxLength            int     `json:"model_max_length"`
	CleanUpTokenizationSpaces bool    `json:"clean_up_tokenization_spaces"`
	AddBOSToken               bool    `json:"add_bos_token"`
	AddEOSToken               bool    `json:"add_eos_token"`
	SplitSpecialTokens        bool    `json:"split_special_tokens"`
}

// bpeFiles returns tokenizer.json and tokenizer_config.json of a BPE vocabulary. model.vocab is
// written in id order and the merges as pairs, so the files read as Qwen's do.
func (t *Tokenizer) bpeFiles(maxLen int) (tokJSON, cfgJSON []byte, err error) {
	m := t.bpe
	var mb bytes.Buffer
	mb.WriteString(`{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":"","end_of_word_suffix":"",` +
		`"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,"vocab":{`)
	first := true
	for id, p := range m.vocab {
		if p == "" {
			continue // an added token
		}
		if !first {
			mb.WriteByte(',')
		}
		first = false
		k, _ := json.Marshal(p)
		fmt.Fprintf(&mb, "\n%s:%d", k, id)
	}
	mb.WriteString("},\"merges\":[")
	for r, mg := range m.merges {
		if r > 0 {
			mb.WriteByte(',')
		}
		pair, _ := json.Marshal([2]string{m.vocab[mg[0]], m.vocab[mg[1]]})
		mb.WriteString("\n")
		mb.Write(pair)
	}
	mb.WriteString("]}")
	f := bpeTokenizerFile{
		Version:       "1.0",
		Truncation:    json.RawMessage("null"),
		Padding:       json.RawMessage("null"),
		Normalizer:    json.RawMessage("null"),
		PreTokenizer:  bpePreTokenizer,
		PostProcessor: json.RawMessage("null"),
		Decoder:       bpeDecoder,
		Model:         mb.Bytes(),
	}
	for id := range t.pieces {
		if m.vocab[id] == "" {
			f.AddedTokens = append(f.AddedTokens, hfAddedToken{ID: int32(id), Content: t.pieces[id],
				Special: slices.Index(ChatSpecials, t.pieces[id]) < bpeSpecialCount})
		}
	}
	var out bytes.Buffer
	enc := json.NewEncoder(&out)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(f); err != nil {
		return nil, nil, err
	}
	tokJSON = bytes.Clone(bytes.TrimSuffix(out.Bytes(), []byte("\n")))
	c := bpeTokenizerConfig{
		TokenizerClass: "PreTrainedTokenizerFast",
		ChatTemplate:   QwenChatTemplate,
		EOSToken:       t.pieces[t.eos],
		PadToken:       t.pieces[t.pad],
		ModelMaxLength: maxLen,
	}
	out.Reset()
	enc = json.NewEncoder(&out)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(c); err != nil {
		return nil, nil, err
	}
	return tokJSON, bytes.TrimSuffix(out.Bytes(), []byte("\n")), nil
}

// parseBPE reads a BPE vocabulary's tokenizer.json (already decoded into f) and its
// tokenizer_config.json: exactly the form bpeFiles writes, with the added tokens of
// ChatSpecials after the vocabulary; anything else (another pre-tokenizer, a normalizer, byte
// fallback, another chat template) is refused, naming the field.
func parseBPE(f *hfTokenizerFile, c *tokenizerConfig) (*Tokenizer, error) {
	bad := func(format string, a ...any) error { return &fileError{"tokenizer.json", fmt.Errorf(format, a...)} }
	if f.Model.Type != "BPE" {
		return nil, bad("model.type %q: the tiny engine reads BPE vocabularies only", f.Model.Type)
	}
	if !jsonSame(f.PreTokenizer, bpePreTokenizer) {
		return nil, bad("the tiny engine reads two tokenizers: a character vocabulary (no merges, pre_tokenizer null) and "+
			"the byte-level BPE of TrainBPE, whose pre_tokenizer is Sequence[Split(the Qwen2 pattern, Isolated), ByteLevel(add_prefix_space false, use_regex false)]; "+
			"this one has %d merges and pre_tokenizer %s", len(f.Model.Merges), f.PreTokenizer)
	}
	if !jsonSame(f.Decoder, bpeDecoder) {
		return nil, bad("decoder must be ByteLevel, as TrainBPE writes it; got %s", f.Decoder)
	}
	for name, raw := range map[string]json.RawMessage{"normalizer": f.Normalizer, "post_processor": f.PostProcessor} {
		if len(raw) > 0 && string(raw) != "null" {
			return nil, bad("%s must be null (the tiny engine's BPE vocabulary has none); got %s", name, raw)
		}
	}
	if f.Model.UnkToken != nil || f.Model.ByteFallback || f.Model.FuseUnk || f.Model.IgnoreMerges ||
		(f.Model.ContinuingSubwordPrefix != nil && *f.Model.ContinuingSubwordPrefix != "") ||
		(f.Model.EndOfWordSuffix != nil && *f.Model.EndOfWordSuffix != "") || f.Model.Dropout != nil {
		return nil, bad("model: unk_token, dropout, byte_fallback, fuse_unk, ignore_merges, " +
			"continuing_subword_prefix and end_of_word_suffix are not supported by a byte-level vocabulary")
	}
	n := len(f.Model.Vocab)
	vocab := make([]string, n)
	for p, id := range f.Model.Vocab {
		if id < 0 || int(id) >= n || vocab[id] != "" || p == "" {
			return nil, bad("model.vocab ids must be 0..%d, each once (token %q has id %d)", n-1, p, id)
		}
		vocab[id] = p
	}
	merges := make([][2]int32, len(f.Model.Merges))
	for r, raw := range f.Model.Merges {
		var a, b string
		switch v := raw.(type) {
		case string:
			var ok bool
			if a, b, ok = strings.Cut(v, " "); !ok {
				return nil, bad("model.merges[%d] %q is not two tokens", r, v)
			}
		case []any:
			if len(v) != 2 {
				return nil, bad("model.merges[%d] is not a pair", r)
			}
			a, _ = v[0].(string)
			b, _ = v[1].(string)
		}
		ia, oka := f.Model.Vocab[a]
		ib, okb := f.Model.Vocab[b]
		if !oka || !okb {
			return nil, bad("model.merges[%d] (%q %q) joins a token that is not in model.vocab", r, a, b)
		}
		merges[r] = [2]int32{ia, ib}
	}
	var specials []string
	for i, a := range f.AddedTokens {
		if int(a.ID) != n+i {
			return nil, bad("added token %q has id %d; the added tokens follow model.vocab (id %d on)", a.Content, a.ID, n)
		}
		if a.LStrip || a.RStrip || a.SingleWord || a.Normalized {
			return nil, bad("added token %q: lstrip, rstrip, single_word and normalized must be false", a.Content)
		}
		specials = append(specials, a.Content)
	}
	t, err := newBPETokenizer(vocab, merges, specials)
	if err != nil {
		return nil, &fileError{"tokenizer.json", err}
	}
	cfgErr := func(format string, a ...any) error {
		return &fileError{"tokenizer_config.json", fmt.Errorf(format, a...)}
	}
	if strings.TrimSpace(c.ChatTemplate) != strings.TrimSpace(QwenChatTemplate) {
		return nil, cfgErr("chat_template is not the Qwen3-form template the tiny engine renders with a BPE vocabulary (tiny.QwenChatTemplate)")
	}
	if c.EOSToken != tokIMEnd || c.PadToken != tokEndOfText {
		return nil, cfgErr("eos_token must be %s and pad_token %s, got %q and %q", tokIMEnd, tokEndOfText, c.EOSToken, c.PadToken)
	}
	return t, nil
}

// jsonSame says whether two JSON texts hold the same value (key order and spacing aside).
func jsonSame(a, b []byte) bool {
	var va, vb any
	if json.Unmarshal(a, &va) != nil || json.Unmarshal(b, &vb) != nil {
		return false
	}
	ja, _ := json.Marshal(va)
	jb, _ := json.Marshal(vb)
	return bytes.Equal(ja, jb)
}
