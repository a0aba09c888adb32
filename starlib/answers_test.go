package starlib

import (
	"strings"
	"testing"
)

func TestBoxed(t *testing.T) {
	cases := []struct {
		text, want string
		ok         bool
	}{
		{`so \boxed{42}.`, "42", true},
		{`\boxed{1} then \boxed{2}`, "2", true},
		{`\boxed{\frac{1}{2}}`, `\frac{1}{2}`, true},
		{`\boxed{ \{1, 2\} }`, `\{1, 2\}`, true},
		{`\fbox{7}`, "7", true},
		{`\boxed {3}`, "3", true},
		{`$\boxed 5$ done`, "5", true},
		{`\boxed{1} and finally \boxed{2`, "1", true}, // cut off: the last closed box counts
		{`no box here`, "", false},
		{`\boxed{`, "", false},
		{`\boxedx{3}`, "", false},
		{`\fbox{1} \boxed{2}`, "2", true},
		{`\boxed{2} \fbox{1}`, "1", true},
	}
	for _, c := range cases {
		got, ok := Boxed(c.text)
		if got != c.want || ok != c.ok {
			t.Errorf("Boxed(%q) = %q, %v; want %q, %v", c.text, got, ok, c.want, c.ok)
		}
	}
}

func TestExtract(t *testing.T) {
	cases := []struct {
		text, want string
		ok         bool
	}{
		{"Answer: 42", "42", true},
		{"work\nAnswer: 1\nmore\nFinal answer:  7 \n", "7", true},
		{"ANSWER : -3", "-3", true},
		{"Answer:\n12", "12", true},
		{"The answer is 5", "", false},
	}
	for _, c := range cases {
		got, ok := Extract(c.text)
		if got != c.want || ok != c.ok {
			t.Errorf("Extract(%q) = %q, %v; want %q, %v", c.text, got, ok, c.want, c.ok)
		}
	}
}

func TestNormalize(t *testing.T) {
	cases := []struct{ in, want string }{
		{" 42 ", "42"},
		{"$42$", "42"},
		{"1.50", "1.5"},
		{"3.0", "3"},
		{"3.", "3"},
		{"007", "7"},
		{".5", "0.5"},
		{"-0", "0"},
		{"+5", "5"},
		{"5.", "5"},
		{"x = 5", "5"},
		{"1{,}000", "1000"},
		{"1,000,000", "1000000"},
		{"1,2", "1,2"},
		{`\dfrac{1}{2}`, `\frac{1}{2}`},
		{`\tfrac12`, `\frac{1}{2}`},
		{`\left( 1, 2 \right)`, "(1,2)"},
		{`\leftarrow`, `\leftarrow`},
		{`10\text{ cm}`, "10"},
		{`10 \text{cm}^2`, "10"},
		{`\text{(A)}`, "(A)"},
		{`\text{cm}`, "cm"},
		{`90^\circ`, "90"},
		{`50\%`, "50"},
		{`\boxed{ 3/4 }`, `\frac{3}{4}`},
		{`-3/4`, `-\frac{3}{4}`},
		{`2\sqrt2`, `2\sqrt{2}`},
		{`1\!000\,000`, "1000000"},
		{`\$5.00`, "5"},
		{"hello world", "helloworld"},
	}
	for _, c := range cases {
		if got := Normalize(c.in); got != c.want {
			t.Errorf("Normalize(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestEqual(t *testing.T) {
	cases := []struct {
		a, b string
		want bool
	}{
		// integers and decimals
		{"42", "42", true},
		{"42", " 42 ", true},
		{"42", "42.0", true},
		{"1.5", "1.50", true},
		{"0.5", ".5", true},
		{"1000", "1,000", true},
		{"1e3", "1000", true},
		{"12345678901234567890", "12345678901234567890.0", true},
		// fractions
		{`\frac{1}{2}`, "0.5", true},
		{`\dfrac{1}{2}`, `\frac{1}{2}`, true},
		{`\tfrac{3}{4}`, "0.75", true},
		{`\frac{2}{4}`, `\frac12`, true},
		{"1/2", `\frac{1}{2}`, true},
		{"3/6", "0.5", true},
		{`\frac{1}{3}`, "0.3333333333", true},
		// negative numbers
		{"-3", "-3.0", true},
		{`-\frac{1}{2}`, "-0.5", true},
		{`\frac{-1}{2}`, "-1/2", true},
		{"-0", "0", true},
		// spaces, \left/\right, trailing period, $, units, boxed
		{`( 1 , 2 )`, "(1,2)", true},
		{`\left(1,2\right)`, "(1,2)", true},
		{"7.", "7", true},
		{"The answer.", "Theanswer", true},
		{"$5$", "5", true},
		{`5\text{ meters}`, "5", true},
		{`\boxed{5}`, "5", true},
		{`\sqrt{2}`, `\sqrt2`, true},
		// mismatches
		{"42", "43", false},
		{"0.333333", `\frac{1}{3}`, false},
		{"1/2", "2", false},
		{"-3", "3", false},
		{`\frac{1}{0}`, `\frac{2}{0}`, false},
		{"x+1", "x+2", false},
		{"", "", false},
		{"1,2", "12", false},
		{"1e999999", "1e999998", false},
	}
	for _, c := range cases {
		if got := Equal(c.a, c.b); got != c.want {
			t.Errorf("Equal(%q, %q) = %v, want %v", c.a, c.b, got, c.want)
		}
		if got := Equal(c.b, c.a); got != c.want {
			t.Errorf("Equal(%q, %q) = %v, want %v (not symmetric)", c.b, c.a, got, c.want)
		}
	}
}

func TestGrade(t *testing.T) {
	// The window counts characters, not bytes: "é" is two bytes.
	long := "Answer: 5\n" + strings.Repeat("é", 300)
	short := "Answer: 5\n" + strings.Repeat("é", 290)
	cases := []struct {
		response, label, mode string
		requireThink          bool
		want                  float64
	}{
		{`so \boxed{5}`, "5", GradeMath, false, 1},
		{`so \boxed{6}`, "5", GradeMath, false, 0},
		{`no box, just 5`, "5", GradeMath, false, 0},
		{`<think>maybe \boxed{5}</think> \boxed{5.0}`, "5", GradeMath, false, 1},

		{`<think>\boxed{4}</think> so \boxed{5}`, "5", GradeDeepscaler, false, 1},
		{`<think>\boxed{5}</think> so \boxed{4}`, "5", GradeDeepscaler, false, 0},
		{`<think>\boxed{5}</think> no box after`, "5", GradeDeepscaler, false, 0},
		{`<think>still thinking \boxed{5}`, "5", GradeDeepscaler, false, 0},
		{`thinking began in the prompt</think> \boxed{5}`, "5", GradeDeepscaler, false, 1},
		{`\boxed{5}`, "5", GradeDeepscaler, false, 1}, // no think tags: graded whole
		{`\boxed{5}`, "5", GradeDeepscaler, true, 0},
		{`<think>x</think>\boxed{5}`, "5", GradeDeepscaler, true, 1},

		{"work\nAnswer: 5", "5", GradeDAPO, false, 1},
		{"Answer: 5.", "5", GradeDAPO, false, -1}, // DAPO keeps the period
		{"Answer: 4", "5", GradeDAPO, false, -1},
		{`\boxed{5}`, "5", GradeDAPO, false, -1},
		{long, "5", GradeDAPO, false, -1},
		{short, "5", GradeDAPO, false, 1},
	}
	for _, c := range cases {
		got, err := Grade(c.response, TextLabel(c.label), c.mode, GradeOptions{NoThinkOK: !c.requireThink && c.mode == GradeDeepscaler})
		if err != nil || got != c.want {
			t.Errorf("Grade(%q, %q, %s, %v) = %v, %v; want %v", c.response, c.label, c.mode, c.requireThink, got, err, c.want)
		}
	}
	if _, err := Grade("x", TextLabel("5"), "exact", GradeOptions{}); err == nil {
		t.Error("Grade with an unknown mode succeeded")
	}
	if _, err := Grade("x", TextLabel("5"), GradeMath, GradeOptions{NoThinkOK: true}); err == nil {
		t.Error("Grade accepted require_think for mode math")
	}
}

func TestAnswersScript(t *testing.T) {
	header := `load("@slimen//answers.star", "boxed", "extract", "normalize", "equal", "grade")`
	runScriptCases(t, header, []scriptCase{
		{src: `got = boxed("the answer is \\boxed{\\frac{1}{2}}")`, want: `"\\frac{1}{2}"`},
		{src: `got = boxed("none")`, want: "None"},
		{src: `got = extract("Answer: 12")`, want: `"12"`},
		{src: `got = [normalize(" 1.50 "), normalize(None), normalize(3.0), normalize(7)]`, want: `["1.5", None, "3", "7"]`},
		{src: `got = [equal("0.5", "\\dfrac{1}{2}"), equal(None, None), equal(None, "1"), equal(2, "2.0"), equal(0.25, "1/4")]`,
			want: "[True, False, False, True, True]"},
		{src: `got = grade("\\boxed{5}", 5)`, want: "1.0"},
		{src: `got = grade("\\boxed{5}", "6")`, want: "0.0"},
		{src: `got = grade("Answer: 6", ["5", 6], mode = "dapo")`, want: "1.0"},
		{src: `got = grade("Answer: 7", ["5", 6], mode = "dapo")`, want: "-1.0"},
		{src: `got = grade("\\boxed{5}", "5", mode = "deepscaler", require_think = True)`, want: "0.0"},
		{src: `got = boxed(5)`, wantErr: "answers.boxed: for parameter text: got int, want string"},
		{src: `got = equal([1], "1")`, wantErr: "answers.equal: for parameter a: got list, want string, int, float or None"},
		{src: `got = grade("x", None)`, wantErr: "answers.grade: for parameter label: got None; this task has no label"},
		{src: `got = grade("x", [])`, wantErr: "answers.grade: for parameter label: got an empty list"},
		{src: `got = grade("x", "1", mode = "exact")`, wantErr: `answers.grade: unknown mode "exact"`},
		{src: `got = grade("x", "1", require_think = False)`, wantErr: `answers.grade: require_think applies to mode "deepscaler" only`},
		{src: `got = grade("\\boxed{5}", "5", mode = "deepscaler")`, want: "0.0"},
		{src: `got = grade("\\boxed{5}", "5", mode = "deepscaler", require_think = False)`, want: "1.0"},
		{src: `got = grade("<think>\\boxed{5}", "5", mode = "deepscaler", require_think = False)`, want: "0.0"},
		{src: `got = [grade("\\boxed{2/4}", "1/2"), grade("\\boxed{2/4}", "1/2", lenient = True)]`, want: "[0.0, 1.0]"},
		{src: `got = [equal("0.3333333333", "1/3"), equal("0.3333333333", "1/3", lenient = True)]`, want: "[False, True]"},
		{src: `got = [boxed("\\boxed{1} \\boxed{2"), boxed("\\boxed{1} \\boxed{2", lenient = True)]`, want: `[None, "1"]`},
		{src: `got = [extract("FinalAnswer: 5 "), extract("FinalAnswer: 5 ", lenient = True)]`, want: `["5 ", None]`},
		{src: `got = grade("The capital is Rome", "Rome", mode = "gpqa", choices = ["Paris", "Rome"])`, want: "1.0"},
		{src: `got = grade("Answer: B", 1, mode = "gpqa")`, want: "1.0"},
		{src: `got = grade("the cat", "a cat sat", mode = "f1")`, want: "0.6666666666666666"},
		{src: `got = grade("Answer: 5", "five", mode = "dapo")`, wantErr: `answers.grade: mode "dapo" needs a label that is a finite number`},
		{src: `got = grade("x", "1", lenient = True, mode = "f1")`, wantErr: `answers.grade: lenient applies to modes`},
		{src: `got = grade("x", "1", choices = ["a"])`, wantErr: `answers.grade: choices and metadata apply to mode "gpqa" only`},
		{src: `got = grade("x", "1", mood = "math")`, wantErr: "answers.grade: unexpected keyword argument"},
	})
}

func TestPyFloatRepr(t *testing.T) {
	for f, want := range map[float64]string{
		5: "5.0", -2.5: "-2.5", 0.0001: "0.0001", 0.00001: "1e-05", 1e16: "1e+16", 123456789012345.0: "123456789012345.0",
		1.5e300: "1.5e+300", 0.1: "0.1",
	} {
		if got := pyFloatRepr(f); got != want {
			t.Errorf("pyFloatRepr(%v) = %q, want %q (Python's repr)", f, got, want)
		}
	}
}
