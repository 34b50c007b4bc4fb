"""A fixed English corpus for training the synthetic checkpoints' tokenizers.

Plain text written for this project, so tokenizer training is deterministic
and needs no download. Enough variety for a few hundred BPE merges.
"""

CORPUS = """\
Once upon a time there was a small town at the edge of a quiet forest.
The people of the town woke early, opened their windows and listened to the birds.
A baker named Tom made bread every morning, and the smell filled the street.
Children walked to school with their books, talking about the games they would play.
The teacher asked them to read a story, write a letter and count to one hundred.
In the afternoon the sun was warm, so the children ran to the park by the river.
They played with a red ball, climbed a tall tree and watched the boats go by.
An old man sat on a bench and fed the ducks with small pieces of bread.
He told the children about the ships he had seen when he was young.
"The sea is very big," he said, "and there are many islands far away."
The children listened and asked him many questions about the world.
When the evening came, the sky turned orange and then dark blue.
Their parents called them home for dinner, and they said goodbye to the old man.
At home they ate soup, rice and vegetables, and drank a glass of milk.
After dinner the family read books together and talked about the day.
The little girl wanted to become a scientist and study the stars.
Her brother wanted to build machines that could fly over the mountains.
Their mother worked at the hospital, where she helped people who were sick.
Their father repaired computers and taught them how programs are written.
A computer program is a list of instructions that a machine can follow.
Programs read input, compute something useful and write the output.
Good programs are simple, well tested and easy for other people to read.
The server receives a request, processes it and sends a response back.
Each request has a model, a prompt, a temperature and a maximum number of tokens.
The model predicts the next token, one step at a time, until it reaches the end.
Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in many texts.
What time is it? It is half past seven in the morning.
Where are you going? I am going to the market to buy apples and oranges.
How are you today? I am fine, thank you, and how are you?
The weather was cold in winter, warm in spring, hot in summer and cool in autumn.
Snow covered the roofs, and the children built a snowman with a long carrot nose.
In spring the flowers opened and the trees were green again.
The farmer planted wheat, corn and potatoes in his fields.
His dog ran around the farm and barked at the chickens and the cows.
One day a storm came, with strong wind, heavy rain and loud thunder.
Everyone stayed inside and waited for the storm to pass.
The next morning the air was fresh and the streets were clean.
The town library had thousands of books about history, science and art.
People came to the library to learn, to think and to find quiet.
The librarian knew where every book was and loved to help visitors.
Music played in the square on Sundays, and people danced and sang.
The musicians played the violin, the piano, the guitar and the drums.
A young painter drew the faces of the people and the colors of the sky.
Friends shared their lunch, told jokes and laughed together.
Kindness, patience and courage are important for every person.
The end of the story is happy: the town grew, and the people were kind to each other.
"""
