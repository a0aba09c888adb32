package host

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// This file defines the run's record of rollouts: the lines of rollouts.jsonl
// (docs/observability.md), which slimen view, TensorBoard's text and W&B's tables show.

// RolloutRecord is one line of rollouts.jsonl: one rollout, its task, what it returned or why it
// failed, and its calls in order.
type RolloutRecord struct {
	Step    int          `json:"step"`
	Eval    bool         `json:"eval"`
	Dataset string       `json:"dataset,omitempty"` // the eval dataset; "" for a training step's rollout
	Index   int          `json:"index"`             // the rollout's position among its step's (or eval dataset's)
	Task    TaskRecord   `json:"task"`
	Group   string       `json:"group"`
	Result  string       `json:"result,omitempty"` // what rollout(task) returned, as Starlark prints it
	Error   string       `json:"error,omitempty"`  // why it failed, with the Starlark backtrace
	Calls   []CallRecord `json:"calls"`
}

// TaskRecord is a rollout's task.
type TaskRecord struct {
	ID       string            `json:"id"`
	Prompt   string            `json:"prompt,omitempty"`   // a text prompt
	Messages []engines.Message `json:"messages,omitempty"` // a chat prompt
	Label    *string           `json:"label"`              // null: the task has none
}

// CallRecord is one sampled completion of a rollout (a generate call's sample, a chat turn, an
// agent() program's model call) or a conversation's sample (kind "chat" with turns). Per-token
// fields are parallel arrays, one entry per response token.
type CallRecord struct {
	Policy       string            `json:"policy"`
	Kind         string            `json:"kind"` // "chat": a conversation's sample; "generate": one sampled completion
	ID           string            `json:"id"`
	Messages     []engines.Message `json:"messages,omitempty"` // the prompt's messages (a chat's: its first turn's and after)
	Prompt       string            `json:"prompt,omitempty"`   // a prompt of tokens (no messages), as text where the engine can detokenize it
	PromptTokens int               `json:"prompt_tokens"`
	Response     string            `json:"response"`
	FinishReason string            `json:"finish_reason"`
	Reward       *float64          `json:"reward"` // null: not rewarded
	Trained      bool              `json:"trained"`
	// Turns, for a conversation's sample, are its sampled turns: [start, end) into the token
	// arrays; the tokens between them were injected (messages, tool results) and have mask 0.
	Turns []TurnRecord `json:"turns,omitempty"`
	// TokenIDs, Pieces (each token's text, where the engine can detokenize one token), Mask (the
	// loss mask), Advantage (null where the sample was not trained) and Logprob (the rollout's).
	TokenIDs  []int32   `json:"token_ids"`
	Pieces    []string  `json:"pieces,omitempty"`
	Mask      []float32 `json:"mask"`
	Advantage Floats    `json:"advantage,omitempty"`
	Logprob   Floats    `json:"logprob"`
	// TokensCut counts the response tokens past the record's cap, left out of the arrays.
	TokensCut int `json:"tokens_cut,omitempty"`
}

// Floats are per-token numbers, written with 4 significant digits (what a reader of a rollout
// looks at, in a third less room than float32's shortest form); a value that is not finite is
// written as null.
type Floats []float32

// MarshalJSON writes the numbers with 4 significant digits.
func (fs Floats) MarshalJSON() ([]byte, error) {
	b := make([]byte, 0, 2+len(fs)*8)
	b = append(b, '[')
	for i, f := range fs {
		if i > 0 {
			b = append(b, ',')
		}
		if x := float64(f); math.IsNaN(x) || math.IsInf(x, 0) {
			b = append(b, "null"...)
		} else {
			b = strconv.AppendFloat(b, x, 'g', 4, 32)
		}
	}
	return append(b, ']'), nil
}

// TurnRecord is a conversation's sampled turn: the token range of its response.
type TurnRecord struct {
	Start        int    `json:"start"`
	End          int    `json:"end"`
	Response     string `json:"response"`
	FinishReason string `json:"finish_reason"`
}

// Record bounds: a step's lines stay small however long its rollouts are.
const (
	maxRecordText   = 4000     // bytes of any one text field
	maxRecordTokens = 2048     // tokens of one call's arrays
	maxRecordCalls  = 64       // calls of one rollout
	maxRecordBytes  = 64 << 10 // one rollout's line: past it, the last calls' token arrays go
	evalRecords     = 4        // rollouts kept of each eval dataset (at most run.save_rollouts)
)

// recorder makes the run's record of its steps and evals: it keeps what a step's record needs
// between the step's phases, writes rollouts.jsonl and hands the records to the observers. The
// run owns it (Run.rec) and gives it, when the run is made, the few things it reads of the run:
// the config, a policy's engine (for the text of tokens), the observers and the run's identity.
type recorder struct {
	mu    sync.Mutex
	adv   map[*script.Completion][]float32 // the step's trained samples' advantages
	evals []evalPass                       // the passes of the eval in progress

	out    string         // the run folder; "" writes no file
	events *eventLog      // where a failed write is said
	file   *metricsWriter // rollouts.jsonl once opened
	// failed says a write of rollouts.jsonl failed: said once, the run goes on.
	failed bool

	config    func() *config.Config              // the run's config (a reload may change it)
	engineOf  func(policy string) engines.Engine // a policy's engine; nil for a policy not open
	observers []Observer                         // Options.Observers
	id, wd    string                             // the run's id and working directory, for RunInfo
	obs       *observers                         // Options.Observers and run.tensorboard's, once started
}

// evalPass is one eval dataset's rollouts.
type evalPass struct {
	dataset string
	ros     []*script.Rollout
}

// keepAdvantages notes the advantages the step computed for each policy's samples.
func (rc *recorder) keepAdvantages(byPolicy map[string][]trainSample, advs map[string][][]float32) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.adv = map[*script.Completion][]float32{}
	for name, ss := range byPolicy {
		for i, s := range ss {
			if i < len(advs[name]) {
				rc.adv[s.C] = advs[name][i]
			}
		}
	}
}

// noteEval notes the rollouts of an eval's i-th dataset (the first starts a new eval).
func (rc *recorder) noteEval(i int, dataset string, ros []*script.Rollout) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if i == 0 {
		rc.evals = nil
	}
	rc.evals = append(rc.evals, evalPass{dataset, ros})
}

// takeEval returns and forgets the eval's rollouts; takeAdv the step's advantages.
func (rc *recorder) takeEval() []evalPass {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	e := rc.evals
	rc.evals = nil
	return e
}

func (rc *recorder) takeAdv() map[*script.Completion][]float32 {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	a := rc.adv
	rc.adv = nil
	return a
}

// pickRollouts chooses n of a pass's rollouts, the same ones for the same outcomes: failed ones
// first (at most half of n while others succeeded), then successful ones spread evenly over the
// pass; in the pass's order.
func pickRollouts(ros []*script.Rollout, n int) []*script.Rollout {
	if n <= 0 {
		return nil
	}
	if len(ros) <= n {
		return ros
	}
	var bad, good []int
	for i, ro := range ros {
		if ro.Err != nil {
			bad = append(bad, i)
		} else {
			good = append(good, i)
		}
	}
	nb := min(len(bad), max(n/2, 1))
	if len(good) < n-nb {
		nb = n - len(good)
	}
	ng := n - nb
	picked := append([]int(nil), bad[:nb]...)
	for k := 0; k < ng; k++ {
		picked = append(picked, good[k*len(good)/ng])
	}
	sort.Ints(picked)
	out := make([]*script.Rollout, len(picked))
	for i, j := range picked {
		out[i] = ros[j]
	}
	return out
}

// pieceFunc gives the text of each token, or nil where the policy's engine cannot.
type pieceFunc func(ids []int32) []string

// tokenizerOf is an engine with a tokenizer that can detokenize one token (the tiny engine).
type tokenizerOf interface{ Tokenizer() *tiny.Tokenizer }

// pieces returns the token-text function of a policy's engine; nil where it has none.
func (rc *recorder) pieces(policy string) pieceFunc {
	t, ok := rc.engineOf(policy).(tokenizerOf)
	if !ok || t.Tokenizer() == nil {
		return nil
	}
	tok := t.Tokenizer()
	return func(ids []int32) []string {
		out := make([]string, len(ids))
		for i, id := range ids {
			out[i] = tok.Decode([]int32{id})
		}
		return out
	}
}

// rollout makes the record of one rollout.
func (rc *recorder) rollout(ro *script.Rollout, step int, dataset string, adv map[*script.Completion][]float32) RolloutRecord {
	rec := RolloutRecord{Step: step, Eval: ro.Eval != nil, Dataset: dataset, Index: ro.Index, Group: ro.Group, Task: taskRecord(ro.Task), Calls: []CallRecord{}}
	if ro.Err != nil {
		rec.Error = cutText(script.ErrorText(ro.Err))
	} else if ro.Result != nil {
		rec.Result = cutText(ro.Result.String())
	}
	// A conversation's sample stands for its turns; the turns' own completions are not repeated.
	inConversation := map[*script.Completion]bool{}
	var cs []*script.Completion
	seen := map[*script.Completion]bool{}
	for _, q := range ro.Queued() {
		if q.C.Conversation() && !seen[q.C] {
			seen[q.C] = true
			cs = append(cs, q.C)
			for _, t := range q.C.Turns() {
				inConversation[t] = true
			}
		}
	}
	for _, c := range ro.Generated() {
		if !inConversation[c] && !seen[c] {
			seen[c] = true
			cs = append(cs, c)
		}
	}
	sort.SliceStable(cs, func(i, j int) bool { return cs[i].Before(cs[j]) })
	trained := map[*script.Completion]bool{} // a failed rollout's train() requests are dropped
	for _, q := range ro.Queued() {
		trained[q.C] = ro.Err == nil && ro.Eval == nil
	}
	for i, c := range cs {
		if i == maxRecordCalls {
			break
		}
		rec.Calls = append(rec.Calls, rc.call(c, trained[c], adv[c]))
	}
	return rec
}

func taskRecord(t Task) TaskRecord {
	tr := TaskRecord{ID: t.ID}
	switch p := t.Prompt.(type) {
	case string:
		tr.Prompt = cutText(p)
	case []engines.Message:
		tr.Messages = cutMessages(p)
	default:
		if p != nil {
			tr.Prompt = cutText(fmt.Sprint(p))
		}
	}
	if t.HasLabel {
		l := cutText(t.Label)
		tr.Label = &l
	}
	return tr
}

// call makes the record of one completion; adv is its advantages when it was trained.
func (rc *recorder) call(c *script.Completion, trained bool, adv []float32) CallRecord {
	cr := CallRecord{Policy: c.Policy(), Kind: "generate", ID: c.ID(), PromptTokens: len(c.PromptTokens()),
		Response: cutText(c.Text()), FinishReason: c.FinishReason(), Trained: trained}
	if c.Conversation() {
		cr.Kind = "chat"
	}
	if msgs := c.Messages(); msgs != nil {
		cr.Messages = cutMessages(msgs)
	}
	if rw, ok := c.Reward(); ok && !math.IsNaN(rw) && !math.IsInf(rw, 0) {
		cr.Reward = &rw
	}
	toks, mask, lps := c.Tokens(), c.LossMask(), c.Logprobs()
	n := min(len(toks), maxRecordTokens)
	cr.TokensCut = len(toks) - n
	cr.TokenIDs = toks[:n:n]
	cr.Mask = mask[:min(n, len(mask))]
	cr.Logprob = Floats(lps[:min(n, len(lps))])
	if len(adv) > 0 {
		a := make([]float32, n)
		for i := range a {
			if len(adv) == 1 {
				a[i] = adv[0] * mask[i]
			} else if i < len(adv) {
				a[i] = adv[i]
			}
		}
		cr.Advantage = a
	}
	pieces := rc.pieces(c.Policy())
	if pieces != nil {
		cr.Pieces = pieces(cr.TokenIDs)
		if cr.Messages == nil {
			cr.Prompt = cutText(strings.Join(pieces(c.PromptTokens()), ""))
		}
	}
	if c.Conversation() {
		first := len(c.PromptTokens())
		for _, t := range c.Turns() {
			start := len(t.PromptTokens()) - first
			cr.Turns = append(cr.Turns, TurnRecord{Start: start, End: start + len(t.Tokens()), Response: cutText(t.Text()), FinishReason: t.FinishReason()})
		}
	}
	return cr
}

// cutText bounds a text field at maxRecordText bytes (on a rune boundary), saying how much went.
func cutText(s string) string {
	if len(s) <= maxRecordText {
		return s
	}
	cut := maxRecordText
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + fmt.Sprintf("…[%d more bytes]", len(s)-cut)
}

func cutMessages(ms []engines.Message) []engines.Message {
	out := make([]engines.Message, len(ms))
	for i, m := range ms {
		out[i] = engines.Message{Role: m.Role, Content: cutText(m.Content)}
	}
	return out
}

// openFile is rollouts.jsonl in the run folder, opened when first written (or truncated by a
// resume); nil without a run folder.
func (rc *recorder) openFile() (*metricsWriter, error) {
	if rc.file == nil && rc.out != "" {
		w := &metricsWriter{}
		if err := w.open(filepath.Join(rc.out, rolloutsFile), rc.events); err != nil {
			return nil, err
		}
		rc.file = w
	}
	return rc.file, nil
}

// rolloutsFile is the run's record of rollouts, in its folder.
const rolloutsFile = "rollouts.jsonl"

// truncateAfter drops, on resume, the records of steps after step, as metrics.jsonl's lines are.
func (rc *recorder) truncateAfter(step int) error {
	if rc.out == "" {
		return nil
	}
	if _, err := os.Stat(filepath.Join(rc.out, rolloutsFile)); err != nil {
		return nil // none written yet
	}
	w, err := rc.openFile()
	if err != nil {
		return err
	}
	return w.truncateAfter(step)
}

// write appends a step's (or an eval's) records in one write. A failed write is said once in
// events.log; the run goes on without the records.
func (rc *recorder) write(recs []RolloutRecord) {
	if len(recs) == 0 {
		return
	}
	w, err := rc.openFile()
	if err != nil || w == nil {
		if err != nil && !rc.failed {
			rc.failed = true
			rc.events.printf("rollouts: %v; the run goes on without saving its rollouts", err)
		}
		return
	}
	var b bytes.Buffer
	for _, rec := range recs {
		line, err := recordLine(rec)
		if err == nil {
			b.Write(line)
			b.WriteByte('\n')
		}
	}
	if err := w.writeRaw(b.Bytes()); err != nil && !rc.failed {
		rc.failed = true
		rc.events.printf("rollouts: %v; the run goes on, and its rollouts are not saved until a write succeeds", err)
	} else if err == nil {
		rc.failed = false
	}
}

// recordLine is a record's JSON line, at most maxRecordBytes long where dropping token arrays can
// make it so: the calls' arrays go from the last call back (their tokens counted in tokens_cut),
// their texts stay.
func recordLine(rec RolloutRecord) ([]byte, error) {
	line, err := json.Marshal(rec)
	for i := len(rec.Calls) - 1; err == nil && len(line) > maxRecordBytes && i >= 0; i-- {
		if i == len(rec.Calls)-1 {
			rec.Calls = slices.Clone(rec.Calls) // the observers' copy keeps its arrays
		}
		c := &rec.Calls[i]
		c.TokensCut += len(c.TokenIDs)
		c.TokenIDs, c.Pieces, c.Mask, c.Advantage, c.Logprob = []int32{}, nil, []float32{}, nil, Floats{}
		line, err = json.Marshal(rec)
	}
	return line, err
}

// writeRaw appends whole lines in one write, cut back to the last whole line on failure.
func (w *metricsWriter) writeRaw(b []byte) error {
	if w.f == nil {
		return nil
	}
	if _, err := w.f.Write(b); err != nil {
		if terr := w.f.Truncate(w.size); terr != nil {
			return fmt.Errorf("%s: %w; the partial lines could not be cut back (%v): the next resume drops them", w.f.Name(), err, terr)
		}
		return fmt.Errorf("%s: %w", w.f.Name(), err)
	}
	w.size += int64(len(b))
	return nil
}

// step writes a completed step's rollouts to rollouts.jsonl and hands the step to the
// observers.
func (rc *recorder) step(step int, ros []*script.Rollout, res *StepResult) {
	adv := rc.takeAdv()
	if rc.out == "" && len(rc.observers) == 0 && rc.config().Run.TensorBoard == "" {
		return // nothing to write and no one to tell
	}
	n := rc.config().Run.SaveRollouts
	var recs []RolloutRecord
	for _, ro := range pickRollouts(ros, n) {
		recs = append(recs, rc.rollout(ro, step, "", adv))
	}
	rc.write(recs)
	if !rc.observing(step - 1) {
		return
	}
	rc.obs.step(StepRecord{Step: step, Metrics: copyLines(append(append([]Metrics(nil), res.Policies...), res.Run)),
		Rewards: stepRewards(ros), Advantages: sampleAdvantages(ros, adv), Rollouts: recs})
}

// eval writes an eval's rollouts (a few of each dataset) and hands the eval to the observers;
// step is the steps done before it.
func (rc *recorder) eval(step int, evs []Metrics) {
	evals := rc.takeEval()
	if rc.out == "" && len(rc.observers) == 0 && rc.config().Run.TensorBoard == "" {
		return
	}
	n := min(rc.config().Run.SaveRollouts, evalRecords)
	var recs []RolloutRecord
	for _, p := range evals {
		for _, ro := range pickRollouts(p.ros, n) {
			recs = append(recs, rc.rollout(ro, step, p.dataset, nil))
		}
	}
	rc.write(recs)
	if !rc.observing(step) {
		return
	}
	rc.obs.eval(EvalRecord{Step: step, Metrics: copyLines(evs), Rollouts: recs})
}

// observing says whether the run has observers, making and starting them before their first
// record: Options.Observers and, with run.tensorboard, the TensorBoard writer. done is the steps
// done before the record.
func (rc *recorder) observing(done int) bool {
	if rc.obs == nil {
		list := append([]Observer(nil), rc.observers...)
		if dir := rc.config().Run.TensorBoard; dir != "" {
			list = append(list, newTensorBoardObserver(dir))
		}
		rc.obs = newObservers(rc.events, list)
		rc.obs.start(RunInfo{ID: rc.id, Out: rc.out, WorkDir: rc.wd, Config: rc.config(), Step: done, Resumed: done > 0})
	}
	return len(rc.obs.list) > 0
}

// close closes the observers (after what they were handed; Options.Observers also when the run
// recorded nothing, so what they hold, a sidecar, ends) and rollouts.jsonl. trainErr is the
// error Train last returned (nil: none), which the observers learn.
func (rc *recorder) close(trainErr *error) error {
	var ended error
	if trainErr != nil {
		ended = *trainErr
	}
	if rc.obs == nil {
		for _, o := range rc.observers {
			if o != nil {
				closeObserver(rc.events, o, observerName(o), ended)
			}
		}
	}
	rc.obs.close(ended)
	if rc.file != nil {
		return rc.file.close()
	}
	return nil
}

// stepRewards are each policy's rewards of the step, as reward_mean counts them.
func stepRewards(ros []*script.Rollout) map[string][]float64 {
	out := map[string][]float64{}
	for _, ro := range ros {
		if ro.Err != nil {
			continue
		}
		for _, c := range ro.Generated() {
			if rw, ok := c.Reward(); ok {
				out[c.Policy()] = append(out[c.Policy()], rw)
			}
		}
		for _, q := range ro.Queued() {
			if rw, ok := q.C.Reward(); ok && q.C.Conversation() {
				out[q.C.Policy()] = append(out[q.C.Policy()], rw)
			}
		}
	}
	return out
}

// sampleAdvantages are, per policy, the mean advantage of each trained sample over its trained
// tokens, in the order of the step's samples.
func sampleAdvantages(ros []*script.Rollout, adv map[*script.Completion][]float32) map[string][]float64 {
	out := map[string][]float64{}
	for _, ro := range ros {
		if ro.Err != nil {
			continue
		}
		for _, q := range ro.Queued() {
			a, ok := adv[q.C]
			if !ok {
				continue
			}
			mask := q.C.LossMask()
			var sum, n float64
			for i, m := range mask {
				if m == 0 {
					continue
				}
				if len(a) == 1 {
					sum += float64(a[0])
				} else if i < len(a) {
					sum += float64(a[i])
				}
				n++
			}
			if n > 0 {
				out[q.C.Policy()] = append(out[q.C.Policy()], sum/n)
			}
		}
	}
	return out
}
