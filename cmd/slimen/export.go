package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/tasks"
)

func init() {
	commands["export"] = command{"write a synthetic task source as JSONL (SFT data for the torch engine, or tasks), " +
		"or a LoRA adapter merged into its base (--merge)", cmdExport}
}

// cmdExport writes problems of a synthetic source as JSONL, one object a line:
//
//	--format sft    {"prompt": …, "response": "\\boxed{N}"}: the corpus builtin:tiny-arith was
//	                pretrained on (tasks.Arith.Example: half the prompts list candidate answers, as the
//	                debate's critic prompts do); `python -m slimen_torch sft --data` reads it
//	--format tasks  {"id": …, "prompt": …, "label": …}: the tasks a run on the source sees, as a
//	                data file (data: {path: FILE})
//
// --task synthetic:chat (--format sft only) writes the chat corpus builtin:tiny-chat is pretrained
// on (tasks.ChatCorpus): {"prompt": [messages], "tools": [JSON schemas], "response": …, "kind": …,
// "right": …}, the conversation before an assistant turn as a message list, the tools (omitted
// when none) as schema objects for the chat template, that turn, the corpus part it comes from and
// whether it is the answer the task wants (held-out evaluation scores only those, as
// tasks.ChatEval does). With --token-ids MODEL every sft line also gets "prompt_ids" and
// "response_ids": the token ids the tiny engine trains on for it with MODEL's tokenizer (the
// prompt rendered by the chat template with a generation prompt; the response followed by EOS).
//
// With --merge ADAPTER it writes instead the LoRA adapter folder ADAPTER (a LoRA policy's
// checkpoint or save: folder, PEFT format) folded into its base model (W + s·B·A) as a plain
// Hugging Face folder in --out; the base is the adapter's base_model_name_or_path unless --base
// names it.
func cmdExport(args []string) int {
	f := newExportFlags()
	if err := f.fs.Parse(args); err != nil {
		return flagExit(err)
	}
	p, err := f.plan()
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen export:", err)
		return 2
	}
	return p.run()
}

// exportFlags are the flags of `slimen export`.
type exportFlags struct {
	fs                                     *flag.FlagSet
	task, format, out, merge, base, tokIDs *string
	seed                                   *uint64
	n, start                               *int
}

// newExportFlags defines the flags of both forms, a synthetic source's lines and --merge.
func newExportFlags() *exportFlags {
	fs := flag.NewFlagSet("export", flag.ContinueOnError)
	f := &exportFlags{fs: fs}
	f.task = fs.String("task", "synthetic:arith", "task source: synthetic:arith[?difficulty=N&seed=S] or synthetic:chat (the chat corpus), "+
		"or synthetic:calc, facts or multipart with --format tasks")
	f.seed = fs.Uint64("seed", 1, "seed of the problems (unless --task gives seed=); a run's problems use its run.seed")
	f.n = fs.Int("n", 10000, "number of lines")
	f.start = fs.Int("start", 0, "index of the first problem")
	f.format = fs.String("format", "sft", "sft (prompt/response pairs) or tasks (id/prompt/label)")
	f.out = fs.String("out", "", "output file (default: standard output); with --merge the output folder")
	f.merge = fs.String("merge", "", "a LoRA adapter folder (PEFT) to fold into its base and write as a Hugging Face folder to --out")
	f.base = fs.String("base", "", "with --merge: the base model (a folder or builtin:NAME); default the adapter's base_model_name_or_path")
	f.tokIDs = fs.String("token-ids", "", "with --format sft: add the token ids the tiny engine trains on with this model's tokenizer "+
		"(a folder or builtin:NAME) as prompt_ids and response_ids")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen export [--task synthetic:arith|synthetic:chat] [--seed S] [--n N] [--start I] "+
			"[--format sft|tasks] [--token-ids MODEL] [--out FILE]")
		fmt.Fprintln(fs.Output(), "       slimen export --merge ADAPTER_DIR [--base MODEL] --out DIR")
		fs.PrintDefaults()
	}
	return f
}

// exportPlan is what `slimen export` is to do, its flags checked: fold the LoRA adapter merge
// into its base and write the model to the folder out or, without --merge, write the JSONL lines
// of a synthetic source (lines) to the file out (standard output when "").
type exportPlan struct {
	out         string
	merge, base string // base "": the adapter's own
	lines       func(w io.Writer) error
}

// plan checks the parsed flags and opens --token-ids's tokenizer.
func (f *exportFlags) plan() (*exportPlan, error) {
	if f.fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q", f.fs.Arg(0))
	}
	p := &exportPlan{out: *f.out, merge: *f.merge, base: *f.base}
	if p.merge != "" {
		if p.out == "" {
			return nil, errors.New("--merge needs --out: the folder to write the merged model into")
		}
		return p, nil
	}
	lines, err := f.planLines()
	if err != nil {
		return nil, err
	}
	p.lines = lines
	return p, nil
}

// planLines checks the flags of a synthetic source's export into the writer of its lines: the
// chat corpus (sft only), the tasks of a family without worked responses (tasks only), or
// synthetic:arith's problems in either format.
func (f *exportFlags) planLines() (func(w io.Writer) error, error) {
	task, format, seed, start, n := *f.task, *f.format, *f.seed, *f.start, *f.n
	if *f.base != "" {
		return nil, errors.New("--base goes with --merge")
	}
	if n < 0 || start < 0 {
		return nil, errors.New("--n and --start must not be negative")
	}
	if format != "sft" && format != "tasks" {
		return nil, fmt.Errorf("--format %q: use sft or tasks", format)
	}
	if *f.tokIDs != "" && format != "sft" {
		return nil, errors.New("--token-ids goes with --format sft")
	}
	var tok *exportTokenizer
	if *f.tokIDs != "" {
		t, err := openExportTokenizer(*f.tokIDs)
		if err != nil {
			return nil, fmt.Errorf("--token-ids %s: %v", *f.tokIDs, err)
		}
		tok = t
	}
	// The chat corpus is conversations with worked responses, not tasks.
	if c, ok, err := tasks.ParseChatCorpus(task, seed); ok {
		if err != nil {
			return nil, fmt.Errorf("--task %v", err)
		}
		if format != "sft" {
			return nil, errors.New("--task synthetic:chat is a corpus of conversations with their responses, not tasks: export it with --format sft")
		}
		return func(w io.Writer) error { return writeChat(w, c, start, n, tok) }, nil
	}
	// The synthetic families other than arith (calc, facts, multipart) have tasks but no
	// worked responses: their tasks are exported as a run sees them, metadata as the other keys.
	if name, _, _ := strings.Cut(strings.TrimPrefix(task, "synthetic:"), "?"); strings.HasPrefix(task, "synthetic:") &&
		name != "arith" && slices.Contains(tasks.SyntheticNames, name) {
		if format != "tasks" {
			return nil, fmt.Errorf("--task %s: only synthetic:arith has worked responses to export as --format sft; export its tasks with --format tasks", task)
		}
		src, err := tasks.Open(task, tasks.Options{Seed: seed})
		if err != nil {
			return nil, err
		}
		return func(w io.Writer) error { return writeTasks(w, src, start, n) }, nil
	}
	arith, ok, err := tasks.ParseSpec(task, seed)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("--task %q: only synthetic sources can be exported (synthetic:%s)", task, strings.Join(tasks.SyntheticNames, ", synthetic:"))
	}
	return func(w io.Writer) error { return writeExport(w, arith, start, n, format, tok) }, nil
}

// run merges the adapter into its base or writes the lines; it returns the exit code.
func (p *exportPlan) run() int {
	if p.merge == "" {
		return writeOut(p.out, p.lines)
	}
	if err := tiny.MergeAdapter(context.Background(), p.merge, p.base, p.out, tiny.Options{}); err != nil {
		fmt.Fprintln(os.Stderr, "slimen export --merge:", err)
		return 1
	}
	fmt.Fprintf(os.Stderr, "slimen export: %s merged into its base, written to %s\n", p.merge, p.out)
	return 0
}

// writeOut runs write on the file out (standard output when ""), and returns export's exit code.
func writeOut(out string, write func(io.Writer) error) int {
	var w io.Writer = os.Stdout
	if out != "" {
		f, err := os.Create(out)
		if err != nil {
			fmt.Fprintln(os.Stderr, "slimen export:", err)
			return 2
		}
		defer f.Close()
		w = f
	}
	if err := write(w); err != nil {
		fmt.Fprintln(os.Stderr, "slimen export:", err)
		return 1
	}
	return 0
}

// exportTokenizer is a model's tokenizer as the tiny engine trains with it (--token-ids).
type exportTokenizer struct {
	tok *tiny.Tokenizer
	eos int32
}

func openExportTokenizer(model string) (*exportTokenizer, error) {
	e, err := tiny.Open(model, tiny.Options{Threads: 1})
	if err != nil {
		return nil, err
	}
	defer e.Close()
	info, err := e.Info(context.Background())
	if err != nil {
		return nil, err
	}
	if len(info.EOSTokens) == 0 {
		return nil, fmt.Errorf("the model has no end-of-sequence token to end a response with")
	}
	return &exportTokenizer{e.Tokenizer(), info.EOSTokens[0]}, nil
}

// ids are the prompt and response token ids of an example as tiny.Pretrain makes them.
func (t *exportTokenizer) ids(msgs []engines.Message, tools []string, response string) (prompt, resp []int32, err error) {
	prompt, err = t.tok.EncodeChatTools(msgs, tools, true)
	if err != nil {
		return nil, nil, err
	}
	return prompt, append(t.tok.Encode(response), t.eos), nil
}

// chatLine is one line of the exported chat corpus.
type chatLine struct {
	Prompt      []engines.Message `json:"prompt"`
	Tools       []json.RawMessage `json:"tools,omitempty"`
	Response    string            `json:"response"`
	Kind        string            `json:"kind"`
	Right       bool              `json:"right"`
	PromptIDs   []int32           `json:"prompt_ids,omitempty"`
	ResponseIDs []int32           `json:"response_ids,omitempty"`
}

// writeChat writes examples start to start+n-1 of the chat corpus, with their token ids when tok
// is not nil.
func writeChat(w io.Writer, c tasks.ChatCorpus, start, n int, tok *exportTokenizer) error {
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	enc.SetEscapeHTML(false)
	for i := start; i < start+n; i++ {
		ex := c.Example(i)
		row := chatLine{Prompt: ex.Context, Response: ex.Response, Kind: ex.Kind, Right: ex.Right}
		for k, t := range ex.Tools {
			if !json.Valid([]byte(t)) {
				return fmt.Errorf("%s, example %d: tool schema %d is not JSON: %s", c, i, k, t)
			}
			row.Tools = append(row.Tools, json.RawMessage(t))
		}
		if tok != nil {
			var err error
			if row.PromptIDs, row.ResponseIDs, err = tok.ids(ex.Context, ex.Tools, ex.Response); err != nil {
				return fmt.Errorf("%s, example %d: %w", c, i, err)
			}
		}
		if err := enc.Encode(row); err != nil {
			return err
		}
	}
	return bw.Flush()
}

// writeTasks writes tasks start to start+n-1 of a source as data-file lines: id, prompt, label
// and the metadata as the other keys, which a data file's tasks get back as their metadata.
func writeTasks(w io.Writer, src tasks.Source, start, n int) error {
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	enc.SetEscapeHTML(false)
	for i := start; i < start+n; i++ {
		t := src.Task(i)
		row := map[string]any{}
		for k, v := range t.Metadata {
			row[k] = v
		}
		row["id"], row["prompt"], row["label"] = t.ID, t.Prompt, t.Label
		if err := enc.Encode(row); err != nil {
			return err
		}
	}
	return bw.Flush()
}

func writeExport(w io.Writer, a tasks.Arith, start, n int, format string, tok *exportTokenizer) error {
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	enc.SetEscapeHTML(false)
	for i := start; i < start+n; i++ {
		var row any
		if format == "sft" {
			prompt, response := a.Example(i)
			line := struct {
				Prompt      string  `json:"prompt"`
				Response    string  `json:"response"`
				PromptIDs   []int32 `json:"prompt_ids,omitempty"`
				ResponseIDs []int32 `json:"response_ids,omitempty"`
			}{Prompt: prompt, Response: response}
			if tok != nil {
				var err error
				line.PromptIDs, line.ResponseIDs, err = tok.ids([]engines.Message{{Role: "user", Content: prompt}}, nil, response)
				if err != nil {
					return fmt.Errorf("%s, problem %d: %w", a, i, err)
				}
			}
			row = line
		} else {
			p := a.Problem(i)
			row = struct {
				ID     string `json:"id"`
				Prompt string `json:"prompt"`
				Label  string `json:"label"`
			}{p.ID, p.Prompt, p.Label}
		}
		if err := enc.Encode(row); err != nil {
			return err
		}
	}
	return bw.Flush()
}
